"""``horizon-ray finetune --config job.yaml [--resume] [key=value ...]``: run one job on this node.

Exit codes (docs/CONTRACTS.md): 0 done, 2 bad input (a one-line message, nothing trained or the job refused
to start), 1 crash (the traceback, then a one-line message), 143 stopped by SIGTERM and 130 by Ctrl-C (both
resumable with --resume), 75 another runner holds the output directory (nothing done; retry once it has
stopped), 3 the job's lease moved on (an engine the node agent started; it stopped and wrote nothing more).
Inside a Ray job the command hands the spec to the service's coordinator instead (see
``horizon_ray.cluster.follow``); the node agent runs its jobs with ``python -m horizon_ray.job``, which
always trains here, with these exit codes (``horizon_ray.job.here.run_here``). SIGUSR1 (the node agent's
drain) stops it after the current step with a checkpoint of that step, exit 143.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="JOB.yaml", help="the job spec (YAML)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in output_dir (fresh if none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    parser.add_argument("--print-spec", action="store_true",
                        help="print the resolved job spec (defaults filled in) and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override spec values, e.g. training.lr=1e-4 training.max_steps=200")


def run(args: argparse.Namespace) -> int:
    from horizon_ray.jobspec import JobSpec

    spec = JobSpec.from_yaml(args.config, overrides=args.overrides)
    if args.print_spec:
        print(spec.to_yaml(), end="")
        return 0

    # Inside a Ray job (`ray job submit -- horizon-ray finetune ...`) the spec goes to the service's
    # coordinator, which places it on a node whose RAM holds it; this process follows it to the end.
    from horizon_ray.cluster import should_submit_to_coordinator, submit_and_follow

    if should_submit_to_coordinator():
        from pathlib import Path

        from horizon_ray.commands.submit import local_spec
        from horizon_ray.data.stats import check_spec_data

        # the nodes resolve no relative path: those of the file against the file, the overrides' against here
        data = local_spec(Path(args.config), args.overrides)
        check_spec_data(JobSpec.parse(data))  # a malformed line is refused now, not on the node once placed
        return submit_and_follow(data)
    from horizon_ray.job.here import run_here  # torch and the engine: only for a job that trains here

    return run_here(spec, resume=args.resume, progress=not args.no_progress)
