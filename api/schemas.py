"""Pydantic models of the HTTP edge, and the conversion of the coordinator's plain records into them.

Inside the service everything is a dataclass of ``horizon_ray.cluster.messages``; these models exist
only to shape (and document) what goes over HTTP.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from horizon_ray.cluster.messages import Checkpoint, EventType, JobEvent, JobRecord, JobStatus, NodeInfo


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. not_found, validation_error")
    message: str = Field(description="one human-readable sentence")
    field: str | None = Field(None, description="dotted name of the offending field, when one is to blame")
    details: Any = Field(None, description="extra plain data (per-field errors, per-node verdicts)")


class ErrorBody(BaseModel):
    error: ErrorDetail


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


# Error responses every authenticated route may give; routes add their own.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _err("missing or invalid API key"),
    404: _err("no such resource for this tenant (another tenant's is reported the same way)"),
    413: _err("request body larger than the limit"),
    422: _err("invalid request; `field` names the offending field"),
    429: _err("over one of the tenant's limits (request rate, streams open, uploads); retry after the "
              "Retry-After header's seconds"),
    500: _err("internal error (never carries a traceback)"),
    503: _err("the coordinator is unavailable; retry after the Retry-After header's seconds"),
}
JOB_CREATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    409: _err("the Idempotency-Key was used before with another spec"),
    429: _err("the tenant's quota forbids the job, or it is over its request rate (Retry-After)"),
}
CANCEL_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    409: _err("the job already finished and cannot be cancelled"),
}


class ProgressObject(BaseModel):
    step: int = Field(description="optimizer steps done")
    total_steps: int | None = Field(None, description="optimizer steps the run will take, when known")
    tokens_per_s: float | None = Field(None, description="recent throughput, non-padding tokens per second")
    eta_s: float | None = Field(None, description="estimated seconds to the end of training")
    fraction: float | None = Field(None, description="step / total_steps, when known")


class JobErrorObject(BaseModel):
    code: str
    message: str


class ResultObject(BaseModel):
    output_dir: str | None = Field(None, description="the job's output directory on the cluster's disks")
    final_model: str | None = Field(None, description="the trained model (HF format), once succeeded")
    outputs_url: str = Field(description="where to list and download the outputs")


class QueueInfo(BaseModel):
    position: int | None = Field(None, description="1-based place in the fair queue")
    reason: str | None = Field(None, description="why the job waits")


class JobObject(BaseModel):
    object: Literal["finetune.job"] = "finetune.job"
    id: str
    tenant: str
    name: str | None = None
    status: JobStatus = Field(description="lifecycle state; succeeded, failed and cancelled are final")
    priority: int = 0
    created_at: float = Field(description="unix seconds")
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float | None = None
    spec: dict[str, Any] = Field(description="the job spec as submitted, paths resolved")
    plan: dict[str, Any] | None = Field(None, description="memory plan on the chosen (or best) node")
    node_id: str | None = Field(None, description="node running it, or that last ran it")
    progress: ProgressObject
    metrics: dict[str, Any] = Field(default_factory=dict, description="latest metrics line")
    error: JobErrorObject | None = None
    result: ResultObject
    queue: QueueInfo | None = None
    attempts: int = 0
    last_checkpoint_step: int | None = None
    gpu_indices: list[int] = Field(default_factory=list,
                                   description="the node's GPUs the job holds or last held (resources.gpus of them)")


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = Field(None, description="pass as `after` to get the next page")


class EventObject(BaseModel):
    seq: int = Field(description="1, 2, 3 ... per job")
    job_id: str
    time: float
    type: EventType = Field(description="status | metrics | checkpoint | memory | error")
    data: dict[str, Any] = Field(default_factory=dict)


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventObject]
    has_more: bool
    last_seq: int = Field(description="pass as `after` to get newer events")


class CheckpointObject(BaseModel):
    step: int
    path: str
    time: float


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointObject]


class OutputFile(BaseModel):
    path: str = Field(description="relative to the job's output directory; append to .../outputs/")
    bytes: int
    modified_at: float


class OutputList(BaseModel):
    object: Literal["list"] = "list"
    job_id: str
    data: list[OutputFile]


class ReservationObject(BaseModel):
    job_id: str | None = Field(None, description="null when the job belongs to another tenant")
    mine: bool = Field(description="whether the job is the caller's")
    host_bytes: int
    gpu_bytes: int
    gpu_indices: list[int] = Field(default_factory=list, description="the node's GPUs the job holds")
    since: float


class NodeObject(BaseModel):
    node_id: str
    alive: bool
    ram_bytes: int
    reserved_bytes: int
    free_bytes: int
    gpu_count: int
    gpu_memory_bytes: int
    reserved_gpu_bytes: int
    ledger: list[ReservationObject]


class NodeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[NodeObject]


class QueueEntry(BaseModel):
    id: str
    name: str | None = None
    status: JobStatus
    position: int | None = None
    reason: str | None = None
    priority: int = 0
    created_at: float


class QueueObject(BaseModel):
    object: Literal["queue"] = "queue"
    total_waiting: int = Field(description="jobs of every tenant waiting for a node")
    data: list[QueueEntry] = Field(description="the caller's waiting jobs, in serving order")


class PlanNode(BaseModel):
    model_config = ConfigDict(extra="allow")
    node_id: str
    fits: bool | None = None
    fits_now: bool | None = None
    reason: str | None = None


class PlanResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    decision: str = Field(description="place | queue | reject")
    node_id: str | None = Field(None, description="best node, if any")
    reason: str | None = None
    plan: dict[str, Any] | None = Field(None, description="planner output for the best node")
    nodes: list[PlanNode] = Field(default_factory=list, description="per-node verdicts")


class FileObject(BaseModel):
    object: Literal["file"] = "file"
    id: str = Field(description="file-<hex>; name it in a spec as data.path")
    filename: str
    bytes: int
    created_at: float
    format: str = Field(description="alpaca | messages | sharegpt | text")
    num_examples: int
    sha256: str
    stats: dict[str, Any] | None = Field(None, description=(
        "what the dataset holds: examples, and with ?tokenizer= its tokens, trained tokens, longest and mean "
        "example and a histogram of example lengths in power-of-two bins"))
    deleted: bool = False


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]


class Health(BaseModel):
    status: str


# ---- records -> objects ----------------------------------------------------------------------------


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities (a diverged loss) as the strings "nan", "inf", "-inf": JSON has no
    numbers for them, and one of them must not turn a job's page into a 500."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def job_object(record: JobRecord, base: str = "/finetune") -> JobObject:
    progress = record.progress
    fraction = None
    if progress.total_steps:
        fraction = min(1.0, progress.step / progress.total_steps)
    final = None
    if record.output_dir and record.status == "succeeded":
        final = f"{record.output_dir.rstrip('/')}/final"
    queue = None
    if record.queue_position is not None or record.queue_reason:
        queue = QueueInfo(position=record.queue_position, reason=record.queue_reason)
    return JobObject(
        id=record.id,
        tenant=record.tenant,
        name=record.name,
        status=record.status,
        priority=record.priority,
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        updated_at=record.updated_at,
        spec=json_safe(copy.deepcopy(record.spec)),
        plan=json_safe(copy.deepcopy(record.plan)),
        node_id=record.node_id,
        progress=ProgressObject(step=progress.step, total_steps=progress.total_steps,
                                tokens_per_s=_finite(progress.tokens_per_s), eta_s=_finite(progress.eta_s),
                                fraction=fraction),
        metrics=json_safe(dict(record.metrics or {})),
        error=JobErrorObject(code=record.error.code, message=record.error.message) if record.error else None,
        result=ResultObject(output_dir=record.output_dir, final_model=final,
                            outputs_url=f"{base}/{record.id}/outputs"),
        queue=queue,
        attempts=record.attempts,
        last_checkpoint_step=record.last_checkpoint_step,
        gpu_indices=record.gpus_held,
    )


def event_object(event: JobEvent) -> EventObject:
    return EventObject(**{**event.to_dict(), "data": json_safe(event.data)})


def checkpoint_object(ckpt: Checkpoint) -> CheckpointObject:
    return CheckpointObject(step=ckpt.step, path=ckpt.path, time=ckpt.time)


def node_object(node: NodeInfo, mine: set[str]) -> NodeObject:
    return NodeObject(
        node_id=node.node_id,
        alive=node.alive,
        ram_bytes=node.ram_bytes,
        reserved_bytes=node.reserved_bytes,
        free_bytes=node.free_bytes,
        gpu_count=node.gpu_count,
        gpu_memory_bytes=node.gpu_memory_bytes,
        reserved_gpu_bytes=node.reserved_gpu_bytes,
        ledger=[
            ReservationObject(job_id=r.job_id if r.job_id in mine else None, mine=r.job_id in mine,
                              host_bytes=r.host_bytes, gpu_bytes=r.gpu_bytes, gpu_indices=list(r.gpu_indices),
                              since=r.since)
            for r in node.ledger
        ],
    )
