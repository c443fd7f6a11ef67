from horizon_ray.bench.cli import main

raise SystemExit(main())
