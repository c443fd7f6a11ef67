"""``horizon-ray finetune --config job.yaml [--resume] [key=value ...]``: run one job on this node.

Exit codes (docs/CONTRACTS.md): 0 done, 2 bad input (a one-line message, nothing trained or the job refused
to start), 1 crash (the traceback, then a one-line message), 143 stopped by SIGTERM and 130 by Ctrl-C (both
resumable with --resume), 75 another runner holds the output directory (nothing done; retry once it has
stopped), 3 the job's lease moved on (an engine the node agent started; it stopped and wrote nothing more).
Inside a Ray job the command hands the spec to the service's coordinator instead (see
``horizon_ray.cluster.follow``); the node agent runs its jobs with ``python -m horizon_ray.job``, which
always trains here, with these exit codes (``run_here``). SIGUSR1 (the node agent's drain) stops it after
the current step with a checkpoint of that step, exit 143.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from pathlib import Path


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
    return run_here(spec, resume=args.resume, progress=not args.no_progress)


def run_here(spec, *, resume: bool, progress: bool) -> int:
    """Train `spec` (a checked JobSpec) in this process; the exit code of the module doc. BadInput
    propagates (the caller's ``cli.refusing_bad_input`` makes it exit 2)."""
    from horizon_ray import exit_codes
    from horizon_ray.errors import BadInput
    from horizon_ray.job import runner
    from horizon_ray.job.lease import Fenced
    from horizon_ray.job.runner import STOP_AFTER_STEP, JobTerminated, OutputDirBusy

    def on_sigterm(signum: int, frame: object) -> None:
        raise JobTerminated("stopped by SIGTERM")  # the runner adds the step and what a rerun continues from

    def on_sigusr1(signum: int, frame: object) -> None:
        STOP_AFTER_STEP.set()  # the node drains: checkpoint at the end of this step, then exit 143

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    previous_usr1 = signal.signal(signal.SIGUSR1, on_sigusr1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # the node agent starts engines with it blocked
    try:
        result = runner.run_job(spec, resume=resume, progress=progress)
    except BadInput:
        raise
    except OutputDirBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.OUTPUT_DIR_BUSY
    except Fenced as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.FENCED
    except JobTerminated as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.TERMINATED
    except KeyboardInterrupt as exc:
        print(f"error: {str(exc) or 'interrupted; ' + runner.resume_hint(Path(spec.output_dir).expanduser())}",
              file=sys.stderr)
        return exit_codes.INTERRUPTED
    except Exception as exc:
        traceback.print_exc()
        print(f"error: the job crashed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exit_codes.CRASHED
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, previous_usr1)
    if result.start_step == result.total_steps:
        print(f"done: the job had already finished; final model in {result.final_dir}")
        return 0
    print(f"done: {result.total_steps} steps in {result.wall_s:.1f}s; final model in {result.final_dir}")
    if result.final_eval_loss is not None:
        print(f"eval loss: {_fmt(result.first_eval_loss)} -> {result.final_eval_loss:.4f}")
    out = result.output_dir
    print(f"metrics: {out / 'metrics.jsonl'}; loss curve: {out / 'loss_curve.png'}")
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
