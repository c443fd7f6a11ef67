"""Training a checked job spec in this process, with the exit codes of docs/CONTRACTS.md: what
`horizon-ray finetune` does outside a Ray job and what the node agent's child (`python -m horizon_ray.job`) does
always. It lives in `job/`, below the CLI, so that the child imports nothing of the CLI."""

from __future__ import annotations

import signal
import sys
import traceback
from pathlib import Path

from horizon_ray import exit_codes
from horizon_ray.errors import BadInput
from horizon_ray.job import runner
from horizon_ray.job.lease import Fenced
from horizon_ray.job.metrics import METRICS_FILE
from horizon_ray.job.runner import STOP_AFTER_STEP, JobTerminated, OutputDirBusy
from horizon_ray.jobspec import JobSpec


def run_here(spec: JobSpec, *, resume: bool, progress: bool) -> int:
    """Train `spec` (a checked JobSpec) in this process; returns the exit code (0 done, 75 output directory
    busy, 3 fenced, 143 SIGTERM or drained, 130 Ctrl-C, 1 crash). BadInput propagates (the caller's
    ``errors.refusing_bad_input`` makes it exit 2)."""

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
    print(f"metrics: {out / METRICS_FILE}; loss curve: {out / 'loss_curve.png'}")
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
