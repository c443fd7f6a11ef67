"""``horizon-ray probe``: measure this node's ceilings (the rates the planner's step times come from).

    horizon-ray probe              # the cached probe of this machine, measured now if there is none
    horizon-ray probe --refresh    # measure again
    horizon-ray probe --json

Seconds on a CPU (a few more with a GPU). The node agent runs it when it starts and plans its node's jobs
with the result; ``horizon-ray plan --here`` plans for this machine with it. The cache is
``$HORIZON_RAY_HOME/probe.json``.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--refresh", action="store_true", help="measure again even when a probe is cached")
    parser.add_argument("--json", action="store_true", help="print the probe as JSON")


def run(args: argparse.Namespace) -> int:
    from horizon_ray.probe import cached_probe, describe, probe_path

    quiet = args.json
    probe = cached_probe(refresh=args.refresh,
                         log=None if quiet else lambda msg: print(f"measuring {msg} ...", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(probe.to_dict(), indent=2))
    else:
        print("\n".join(describe(probe)))
        print(f"cached in {probe_path()}; `horizon-ray plan --here` plans this machine with it")
    return 0
