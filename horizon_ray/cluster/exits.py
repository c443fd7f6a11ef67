"""The coordinator's exit policy: what the end of a job's engine process means for the job.

A pure function of the exit the node agent saw (`ExitInfo`) and the job's state, so that the rules read in
one place and are tested without a coordinator: 0 is success (also when a cancel did not reach the engine in
time), a cancelled job ends cancelled, a stop from outside (SIGTERM, Ctrl-C) is resumable after a pause, exit 2
is bad input (the runner refused it, naming the fix) and any other exit code a crash (its traceback is in the
job's log).

A death by signal is an OOM kill only on evidence: the kernel counted an OOM kill while the engine ran, the
engine grew past its plan, or the node ran out of available memory. Without any, SIGKILL (or SIGSEGV, ...) is a
crash of the process, and the job resumes from its last checkpoint. So does a start that found its output
directory still held by an earlier engine (which stops once the lease is the new start's). Both are retried
with a doubling pause, at most MAX_RETRIES starts in a row without a step (`JobRecord.retries`); then the job
fails with the cause.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from horizon_ray import exit_codes
from horizon_ray.cluster.messages import ErrorCode, ExitInfo, JobStatus
from horizon_ray.cluster.tenants import format_bytes

RETRY_AFTER_S = 10.0  # a job whose engine was stopped from outside is placed again no sooner than this
MAX_RETRIES = 5  # starts in a row that end without a step (killed without OOM evidence, output dir busy)
MAX_RETRY_PAUSE_S = 300.0  # the doubling pause between such starts stops growing here
# The node ran out of memory while the engine ran when what it had available fell below this share of its RAM
# (or below LOW_MEMORY_BYTES, on a small node).
LOW_MEMORY_FRACTION = 0.03
LOW_MEMORY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Outcome:
    """What becomes of the job."""

    status: JobStatus  # SUCCEEDED, CANCELLED, FAILED, or RECOVERING (resumes from its last checkpoint)
    reason: str  # the status event's reason (RECOVERING: why it is gone)
    code: ErrorCode | None = None  # FAILED: the cause
    retry_after_s: float = 0.0  # RECOVERING: the pause before it is placed again
    data: dict[str, Any] = field(default_factory=dict)  # for the status event
    retry: bool = False  # RECOVERING: the start counts against MAX_RETRIES (it ended without a step)


def retry_pause_s(retries: int) -> float:
    """The pause before the `retries`-th start in a row that ended without a step: 10 s, 20 s, 40 s, ..."""
    return min(MAX_RETRY_PAUSE_S, RETRY_AFTER_S * 2 ** max(0, retries - 1))


def oom_evidence(ex: ExitInfo, planned_bytes: int) -> list[str]:
    """What says the engine died of memory: empty when nothing does."""
    found = []
    if ex.oom_kills > 0:
        found.append(f"the kernel counted {ex.oom_kills} OOM kill(s) on the node while it ran")
    if planned_bytes and ex.peak_rss_bytes > planned_bytes:
        found.append(f"it grew to {format_bytes(ex.peak_rss_bytes)}, past the {format_bytes(planned_bytes)} "
                     "planned")
    if ex.min_available_bytes is not None and ex.ram_bytes and \
            ex.min_available_bytes < max(LOW_MEMORY_BYTES, LOW_MEMORY_FRACTION * ex.ram_bytes):
        found.append(f"the node had only {format_bytes(ex.min_available_bytes)} of memory available")
    return found

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
        # an earlier engine of this job (a node that was cut off, now back) still holds output_dir; it stops at
        # its next step now that the lease is the new start's
        return Outcome(JobStatus.RECOVERING, "its output directory was still held by an earlier engine "
                                             f"({last_line(ex.stderr_tail)})", code=ErrorCode.OUTPUT_DIR_BUSY,
                       retry=True)
    if ex.returncode == exit_codes.FENCED:
        # its lease was taken from it while the coordinator still counted on it (its node was briefly lost)
        return Outcome(JobStatus.RECOVERING, f"its engine on node {node_id} lost the job's lease "
                                             f"({last_line(ex.stderr_tail)})", code=ErrorCode.KILLED, retry=True)
    if ex.returncode < 0:
        sig = _signal_name(-ex.returncode)
        seen = f"peak RSS {format_bytes(ex.peak_rss_bytes)} against {format_bytes(planned_bytes)} planned"
        evidence = oom_evidence(ex, planned_bytes) if -ex.returncode == signal.SIGKILL else []
        if not evidence:
            # no sign of memory pressure: the process died (a kill from outside, a segfault); resume it
            return Outcome(JobStatus.RECOVERING, f"its engine on node {node_id} was killed by {sig} with no sign of "
                                                 f"memory pressure ({seen}, no OOM kill counted)",
                           code=ErrorCode.KILLED, retry=True, data=data)
        code, message = ErrorCode.OOM_KILLED, f"engine killed by {sig}, out of memory: {'; '.join(evidence)}"
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
