from horizon_ray.cli import main

raise SystemExit(main())
