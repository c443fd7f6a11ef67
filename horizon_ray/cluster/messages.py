"""Plain-data messages that cross the coordinator, node agent, client and API boundaries.

Everything here is a dataclass or an enum of plain values (str, int, float, dict, list), so it pickles
through Ray, serialises to JSON for the job store and maps one-to-one onto the API's pydantic models.
Byte counts are ints, times are unix seconds (floats). What a job's runner reports (its metrics.jsonl) is
``horizon_ray.job.events``; a node agent hands those on, decoded, in ``AgentJobReport.events``.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from horizon_ray.job.events import Event


class JobStatus(enum.StrEnum):
    """Lifecycle of one fine-tuning job. `TRANSITIONS` is the only source of allowed moves."""

    VALIDATING = "validating"  # spec and plan are being checked; no node chosen yet
    QUEUED = "queued"  # accepted; waits for tenant quota or for a node with enough free RAM
    RUNNING = "running"  # its engine process runs on `node_id` and holds a reservation there
    CHECKPOINTING = "checkpointing"  # running, and writing a checkpoint right now
    RECOVERING = "recovering"  # its node or agent died; waits to resume from its last checkpoint
    CANCELLING = "cancelling"  # cancel asked while running; waits for the engine process to exit
    SUCCEEDED = "succeeded"  # the engine exited 0; the model is in `output_dir/final`
    FAILED = "failed"  # rejected, crashed, OOM-killed or unrecoverable; see `JobRecord.error`
    CANCELLED = "cancelled"  # cancelled by its tenant; its reservation is freed

    def is_terminal(self) -> bool:
        """True for states a job never leaves."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})

# from -> the states it may move to. Terminal states map to the empty set.
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.VALIDATING: frozenset({JobStatus.QUEUED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset(
        {
            JobStatus.CHECKPOINTING,
            JobStatus.RECOVERING,
            JobStatus.CANCELLING,
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
        }
    ),
    JobStatus.CHECKPOINTING: frozenset(
        {
            JobStatus.RUNNING,
            JobStatus.RECOVERING,
            JobStatus.CANCELLING,
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
        }
    ),
    # A recovering job is re-placed (running), cancelled while it has no process, or failed when no
    # node can hold it any more.
    JobStatus.RECOVERING: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    # The engine may finish or crash before the cancel reaches it; its node may die meanwhile.
    JobStatus.CANCELLING: frozenset({JobStatus.CANCELLED, JobStatus.SUCCEEDED, JobStatus.FAILED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


def can_transition(src: JobStatus, dst: JobStatus) -> bool:
    """Whether `src -> dst` is an allowed move (staying in the same state is not a move)."""
    return dst in TRANSITIONS[src]


class EventType(enum.StrEnum):
    """Kinds of entries in a job's event log."""

    STATUS = "status"  # status change: data = {from, to, reason}
    METRICS = "metrics"  # a training or eval metrics line: data = the line's fields (loss, lr, ...)
    CHECKPOINT = "checkpoint"  # a complete checkpoint: data = {step, path}
    MEMORY = "memory"  # memory seen by the node agent: data = {rss_bytes, peak_rss_bytes, planned_bytes}
    ERROR = "error"  # an error reported by the engine or the agent: data = {code, message}


class ErrorCode(enum.StrEnum):
    """Machine-readable causes stored in `JobError.code`."""

    REJECTED = "rejected"  # no node can ever hold the job (see message for the reason)
    INVALID_SPEC = "invalid_spec"  # the spec failed validation (only after a coordinator restart)
    BAD_INPUT = "bad_input"  # the engine refused to start (exit code 2: missing model or data, ...)
    ENGINE_CRASHED = "engine_crashed"  # the engine process exited non-zero
    OOM_KILLED = "oom_killed"  # the engine process was SIGKILLed out of memory (the evidence is in the message)
    KILLED = "killed"  # the engine process died of a signal, again and again (no sign of memory pressure)
    START_FAILED = "start_failed"  # the agent could not start the engine process
    OUTPUT_DIR_BUSY = "output_dir_busy"  # an earlier engine kept holding its output directory, start after start


@dataclass
class JobError:
    """Why a job failed."""

    code: str  # an ErrorCode value
    message: str  # one human-readable sentence, with numbers where they explain the failure


@dataclass
class Progress:
    """Where a job is in its training run (from its latest metrics line)."""

    step: int = 0  # optimizer steps done
    total_steps: int | None = None  # optimizer steps the run will take, when known
    tokens_per_s: float | None = None  # recent training throughput, non-padding tokens per second
    eta_s: float | None = None  # estimated seconds to the end of training


@dataclass
class JobRecord:
    """Everything the service knows about one job: the row of the job table and the API's job object."""

    id: str  # "job-" + 12 hex digits, unique across tenants
    tenant: str  # owning tenant; other tenants never see the job
    name: str | None  # optional human label given at submit
    status: JobStatus  # lifecycle state
    priority: int  # higher runs first among the same tenant's queued jobs
    created_at: float  # submit time
    spec: dict[str, Any]  # the job spec as submitted (the YAML/JSON mapping `horizon-ray finetune` reads)
    started_at: float | None = None  # first time it started running
    finished_at: float | None = None  # time it reached a terminal state
    updated_at: float | None = None  # last change of any field
    plan: dict[str, Any] | None = None  # planner output for its (chosen or best) node: host_bytes, ...
    node_id: str | None = None  # node running it (or that last ran it)
    progress: Progress = field(default_factory=Progress)  # step / total / speed / eta
    metrics: dict[str, Any] = field(default_factory=dict)  # latest metrics line (loss, lr, grad_norm...)
    error: JobError | None = None  # set when FAILED
    output_dir: str | None = None  # where checkpoints, metrics.jsonl and final/ are written
    queue_reason: str | None = None  # why it is QUEUED or RECOVERING and not running
    queue_position: int | None = None  # 1-based position in the fair queue while QUEUED/RECOVERING
    idempotency_key: str | None = None  # a second submit with the same (tenant, key) returns this job
    attempts: int = 0  # how many times an engine process was started for it (1 + recoveries)
    last_checkpoint_step: int | None = None  # step of its newest complete checkpoint
    gpu_index: int | None = None  # GPU of `node_id` its engine holds or last held (None: a CPU job, never placed)
    gpu_indices: list[int] = field(default_factory=list)  # all of them (resources.gpus); gpu_index is the first
    last_seq: int = 0  # seq of its newest event (filled in by the job store when it reads the record)
    retries: int = 0  # starts in a row that ended without a step (killed, output directory busy): bounded
    cpu_threads: int = 0  # the engine threads of its first attempt, pinned for every later one (0: not started)

    @property
    def gpus_held(self) -> list[int]:
        """The GPUs of `node_id` it holds or last held (a record written before gpu_indices: its gpu_index)."""
        return list(self.gpu_indices) or ([self.gpu_index] if self.gpu_index is not None else [])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (enums become their values)."""
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobRecord:
        d = dict(d)
        d["status"] = JobStatus(d["status"])
        d["progress"] = Progress(**(d.get("progress") or {}))
        d["error"] = JobError(**d["error"]) if d.get("error") else None
        return cls(**d)


@dataclass
class JobEvent:
    """One entry of a job's append-only event log."""

    seq: int  # 1, 2, 3 ... per job; clients page with `after_seq`
    job_id: str  # the job it belongs to
    time: float  # when it happened (engine time for metrics, coordinator time otherwise)
    type: EventType  # what kind of entry
    data: dict[str, Any] = field(default_factory=dict)  # the entry's fields (see EventType)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "job_id": self.job_id, "time": self.time, "type": self.type.value,
                "data": self.data}


@dataclass
class Reservation:
    """One line of a node's reservation ledger: memory set aside for a running job."""

    job_id: str  # the job holding it
    host_bytes: int  # host RAM the planner said the job needs
    gpu_bytes: int  # GPU memory the planner said the job needs (0 on CPU)
    since: float  # when it was taken
    # the node's GPUs the job holds, alone (its CUDA_VISIBLE_DEVICES, one per rank: resources.gpus); []: CPU job
    gpu_indices: list[int] = field(default_factory=list)
    cpu_threads: int = 0  # its share of the node's cores (OMP_NUM_THREADS, HORIZON_RAY_OPTIMIZER_THREADS)
    tenant: str | None = None  # the job's tenant (the API shows a tenant its own jobs in a node's ledger)

    @property
    def gpu_index(self) -> int | None:
        """The first of its GPUs (None: a CPU job)."""
        return self.gpu_indices[0] if self.gpu_indices else None


@dataclass
class NodeInfo:
    """What a node agent reports about its node."""

    node_id: str  # logical node name (e.g. "a" in --simulate-nodes, else the Ray node id)
    ram_bytes: int  # host RAM the node offers to jobs (declared when simulated)
    gpu_count: int = 0  # GPUs on the node (logical ones when simulated); one GPU job per GPU
    gpu_memory_bytes: int = 0  # memory of one GPU
    reserved_bytes: int = 0  # host RAM held by the ledger
    reserved_gpu_bytes: int = 0  # GPU memory held by the ledger
    ledger: list[Reservation] = field(default_factory=list)  # one entry per running job
    alive: bool = True  # false once the node or its agent is gone
    ray_node_id: str | None = None  # Ray's hex node id, when running on Ray
    incarnation: str | None = None  # changes when the agent restarts (its jobs' processes are gone)
    cpu_count: int = 0  # cores the agent splits among its engines (0: unknown)
    # the node's measured ceilings, {"values": {Ceilings field: rate}, "source": str} (horizon_ray.probe), once its
    # agent probed it; None: the planner's defaults, labelled assumed
    ceilings: dict[str, Any] | None = None
    engine_lease_s: float = 0.0  # the agent stops its engines at most this long after the coordinator's last
    # call (its lease and the kill grace; 0: never): the coordinator waits this long before it recovers them

    @property
    def free_bytes(self) -> int:
        """Host RAM not held by the ledger."""
        return self.ram_bytes - self.reserved_bytes

    @property
    def busy_gpus(self) -> list[int]:
        """Indices of the GPUs a job holds, ascending."""
        return sorted(i for r in self.ledger for i in r.gpu_indices)

    @property
    def free_gpus(self) -> int:
        """GPUs no job holds."""
        return max(0, self.gpu_count - len(self.busy_gpus))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["free_bytes"] = self.free_bytes
        d["busy_gpus"] = self.busy_gpus
        d["free_gpus"] = self.free_gpus
        return d


@dataclass
class Checkpoint:
    """A complete checkpoint of a job (its directory has the COMPLETE marker)."""

    step: int  # optimizer steps done when it was written
    path: str  # its directory
    time: float  # when it completed


@dataclass
class TenantQuota:
    """Limits of one tenant (from the tenants file; unknown tenants get the default)."""

    max_concurrent_jobs: int = 4  # jobs running, cancelling or recovering at once
    max_reserved_bytes: int = 2**62  # host RAM its running jobs may hold together
    max_queued_jobs: int = 1000  # jobs it may have waiting; submit raises QuotaExceeded beyond
    # optimizer steps one job may take (None: the spec's own bound, jobspec.MAX_STEPS); with a cap, a job must
    # set training.max_steps (epochs alone has no step count before the data is read)
    max_steps_per_job: int | None = None
    # tokens one job may train on: max_steps x seq_len x micro_batch_size x grad_accum x resources.gpus (None: no
    # cap); with a cap, a job must set training.max_steps
    max_tokens_per_job: int | None = None


@dataclass
class ExitInfo:
    """How a job's engine process ended, as the node agent saw it."""

    returncode: int  # process exit code; negative: killed by signal -returncode
    cancelled: bool  # the agent was asked to stop it
    peak_rss_bytes: int  # largest resident set the agent sampled
    stderr_tail: str  # last lines of its stderr
    time: float  # when the agent saw it exit
    oom_kills: int = 0  # OOM kills the kernel counted while it ran (machine-wide and in the node's memory cgroup)
    min_available_bytes: int | None = None  # the least memory the node had available while it ran (sampled)
    ram_bytes: int = 0  # the node's RAM offered to jobs (what min_available_bytes is measured against)


@dataclass
class Launch:
    """What the coordinator asks a node agent to start: one job's engine, with a reservation."""

    job_id: str  # the job
    tenant: str  # its tenant (kept on the reservation)
    spec: dict[str, Any]  # the job spec, normalised by the coordinator
    output_dir: str  # where it writes (the agent puts the spec there as job.yaml)
    host_bytes: int  # host RAM to reserve: the planner's host_bytes on this node
    gpu_bytes: int  # GPU memory it needs there (0 on CPU)
    attempt: int = 1  # 1 + recoveries: names the attempt's log file
    needs_gpu: bool | None = None  # the coordinator's decision; None: placement.needs_gpu's rule on the spec
    gpus: int = 1  # GPUs it holds when it needs any (the spec's resources.gpus: one rank on each)
    # the engine threads of the job's first attempt, given again to every later one (the thread count decides
    # the CPU kernels' reduction order: a resumed run is bit-exact only with the same); 0: the node's share
    cpu_threads: int = 0


@dataclass
class AgentJobReport:
    """What a node agent says about one of its jobs on each poll."""

    job_id: str  # the job
    events: list[Event]  # the runner's new events since the acknowledged offset, decoded
    next_offset: int  # byte offset of metrics.jsonl to ack on the next poll
    rss_bytes: int  # resident set of the process now (0 when it exited)
    peak_rss_bytes: int  # largest resident set seen
    exit: ExitInfo | None  # set once the process has exited (the reservation is already freed)
