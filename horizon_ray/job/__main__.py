"""``python -m horizon_ray.job --config SPEC.yaml [--resume]``: the node agent's child process.

It trains the job in this process, always: unlike ``horizon-ray finetune`` it never hands the spec to a
coordinator, whatever the environment says. Exit codes and outputs are finetune's (docs/CONTRACTS.md).
"""

from __future__ import annotations

import argparse

from horizon_ray.errors import refusing_bad_input


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m horizon_ray.job", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, metavar="SPEC.yaml", help="the job spec the agent wrote")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args = parser.parse_args(argv)

    def run() -> int:
        from horizon_ray.job.here import run_here  # torch and the engine: after the arguments are read
        from horizon_ray.jobspec import JobSpec

        return run_here(JobSpec.from_yaml(args.config), resume=args.resume, progress=True)

    return refusing_bad_input(run)


if __name__ == "__main__":
    raise SystemExit(main())
