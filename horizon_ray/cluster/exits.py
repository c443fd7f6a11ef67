"""The coordinator's exit policy: what the end of a job's engine process means for the job.

A pure function of the exit the node agent saw (`ExitInfo`) and the job's state, so that the rules read in
one place and are tested without a coordinator: 0 is success (also when a cancel did not reach the engine in
time), a cancelled job ends cancelled, a stop from outside (SIGTERM, Ctrl-C, another runner still holding
the output directory) is resumable after a pause, SIGKILL is most likely the OOM killer, exit 2 is bad input
(the runner refused it, naming the fix) and anything else a crash (its traceback is in the job's log).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from horizon_ray import exit_codes
from horizon_ray.cluster.messages import ErrorCode, ExitInfo, JobStatus
from horizon_ray.cluster.tenants import format_bytes

RETRY_AFTER_S = 10.0  # a job whose engine was stopped from outside is placed again no sooner than this


@dataclass(frozen=True)
class Outcome:
    """What becomes of the job."""

    status: JobStatus  # SUCCEEDED, CANCELLED, FAILED, or RECOVERING (resumes from its last checkpoint)
    reason: str  # the status event's reason (RECOVERING: why it is gone)
    code: ErrorCode | None = None  # FAILED: the cause
    retry_after_s: float = 0.0  # RECOVERING: the pause before it is placed again
    data: dict[str, Any] = field(default_factory=dict)  # for the status event


def exit_outcome(ex: ExitInfo, status: JobStatus, planned_bytes: int, node_id: str | None) -> Outcome:
    """The outcome of an engine exit `ex` of a job in `status` that planned `planned_bytes` on `node_id`."""
    data = {"returncode": ex.returncode, "peak_rss_bytes": ex.peak_rss_bytes, "planned_bytes": planned_bytes}
    if ex.returncode == 0 and not ex.cancelled:
        # also when a cancel was asked for but never reached the engine: it finished, its model is written
        why = "engine exited 0" + (" before the cancel reached it" if status is JobStatus.CANCELLING else "")
        return Outcome(JobStatus.SUCCEEDED, why, data=data)
    if status is JobStatus.CANCELLING or ex.cancelled:
        return Outcome(JobStatus.CANCELLED, "engine stopped after cancel", data=data)
    if ex.returncode in (exit_codes.TERMINATED, exit_codes.INTERRUPTED, -signal.SIGTERM):
        # stopped from outside (node drain, pod eviction, shutdown), not by a cancel: resumable
        return Outcome(JobStatus.RECOVERING, f"its engine was stopped by a signal (exit {ex.returncode}) on node "
                                             f"{node_id}", retry_after_s=RETRY_AFTER_S)
    if ex.returncode == exit_codes.OUTPUT_DIR_BUSY:
        # an earlier engine of this job (a node that was cut off, now back) still holds output_dir
        return Outcome(JobStatus.RECOVERING, "its output directory was still held by an earlier engine "
                                             f"({last_line(ex.stderr_tail)})", retry_after_s=RETRY_AFTER_S)
    if ex.returncode < 0:
        sig = _signal_name(-ex.returncode)
        seen = f"peak RSS {format_bytes(ex.peak_rss_bytes)} against {format_bytes(planned_bytes)} planned"
        if -ex.returncode == signal.SIGKILL:
            code, message = ErrorCode.OOM_KILLED, f"engine killed by {sig}, most likely out of memory ({seen})"
        else:
            code, message = ErrorCode.KILLED, f"engine killed by {sig} ({seen})"
    else:
        last = last_line(ex.stderr_tail)
        code = ErrorCode.BAD_INPUT if ex.returncode == exit_codes.BAD_INPUT else ErrorCode.ENGINE_CRASHED
        message = f"engine exited with code {ex.returncode}" + (f": {last}" if last else "")
    return Outcome(JobStatus.FAILED, message, code=code, data={**data, "stderr_tail": ex.stderr_tail[-2000:]})


def last_line(text: str) -> str:
    """The last non-blank line of `text` (a process's stderr, an exception), at most 500 characters."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else ""


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
