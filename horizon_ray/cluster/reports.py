"""What a node agent's report on a job (`AgentJobReport`) changes: progress, metrics, checkpoints, the job's
event log and its running/checkpointing state. Kept out of the coordinator's class: a function of the job,
the report and the time, which fills in a `ReportEffects` for the coordinator to store in one transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from horizon_ray.cluster.messages import AgentJobReport, Checkpoint, EventType, JobRecord, JobStatus
from horizon_ray.job import events as ev


@dataclass
class MemoryMark:
    """The last memory event of a job: when, and the peak it showed."""

    time: float = 0.0
    peak: int = 0


@dataclass
class ReportEffects:
    events: list[tuple[float, EventType, dict[str, Any]]] = field(default_factory=list)  # for the job's log
    checkpoints: list[Checkpoint] = field(default_factory=list)  # completed since the last report
    pruned: list[int] = field(default_factory=list)  # steps of checkpoints the runner deleted
    move: tuple[JobStatus, str] | None = None  # a status change and its reason


def apply_report(job: JobRecord, report: AgentJobReport, now: float, mark: MemoryMark,
                 memory_interval_s: float) -> ReportEffects:
    """Fold `report` into `job` (progress, metrics, last checkpoint) and say what else it changes. `mark`
    (updated here) spaces the job's memory events: one when the peak grew by a tenth of the plan (or 64 MiB),
    and at least every `memory_interval_s`."""
    out = ReportEffects()
    writing: bool | None = None  # a checkpoint is being written at the end of the report (None: no news)
    for e in report.events:
        if isinstance(e, ev.Metrics | ev.Eval):
            line = e.to_dict()
            job.metrics.update({k: v for k, v in line.items() if k not in ("type", "time")})
            if isinstance(e, ev.Metrics):
                job.retries = 0  # a step done: the starts that ended without one are forgiven
                p = job.progress
                p.step = e.step
                p.total_steps = e.total_steps if e.total_steps is not None else p.total_steps
                p.tokens_per_s = e.tokens_per_s if e.tokens_per_s is not None else p.tokens_per_s
                p.eta_s = e.eta_s if e.eta_s is not None else p.eta_s
            out.events.append((e.time, EventType.METRICS, line))
        elif isinstance(e, ev.CheckpointBegin):
            writing = True
        elif isinstance(e, ev.Checkpoint):
            writing = False
            out.checkpoints.append(Checkpoint(step=e.step, path=e.path, time=e.time))
            out.pruned += e.pruned
            job.last_checkpoint_step = e.step
            out.events.append((e.time, EventType.CHECKPOINT, {"step": e.step, "path": e.path}))
        elif isinstance(e, ev.Error):
            out.events.append((e.time, EventType.ERROR, {"code": "engine_error", "message": e.message}))
        elif isinstance(e, ev.Start):
            job.progress.total_steps = e.total_steps
        elif isinstance(e, ev.Done):
            job.progress.step = e.step
    planned = int((job.plan or {}).get("host_bytes") or 0)
    growth = max(planned // 10, 64 * 2**20)
    if report.peak_rss_bytes and (report.peak_rss_bytes > mark.peak + growth or now - mark.time >= memory_interval_s):
        out.events.append((now, EventType.MEMORY, {"rss_bytes": report.rss_bytes,
                                                   "peak_rss_bytes": report.peak_rss_bytes,
                                                   "planned_bytes": planned}))
        mark.time, mark.peak = now, report.peak_rss_bytes
    if report.exit is None and job.status is JobStatus.RUNNING and writing:
        out.move = (JobStatus.CHECKPOINTING, "writing a checkpoint")
    elif report.exit is None and job.status is JobStatus.CHECKPOINTING and writing is False:
        out.move = (JobStatus.RUNNING, "checkpoint written")
    return out
