"""Ray side of horizon-ray: node agents, the RAM-aware coordinator, its job store and its clients.

Plain-data messages (`messages`), typed errors (`errors`) and the client interface (`client`) import
nothing heavy; Ray is imported only by the modules that need it (`ray_actors`, `RayClient`).
"""

from __future__ import annotations

from typing import Any

from horizon_ray.cluster.client import CoordinatorClient, LocalClient, RayClient
from horizon_ray.cluster.errors import (
    CoordinatorUnavailable,
    HorizonError,
    IdempotencyConflict,
    InvalidRequest,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    JobRejected,
    QuotaExceeded,
)
from horizon_ray.cluster.messages import (
    Checkpoint,
    EventType,
    JobError,
    JobEvent,
    JobRecord,
    JobStatus,
    NodeInfo,
    Progress,
    Reservation,
    TenantQuota,
)


def submit_and_follow(spec: dict[str, Any], **kwargs: Any) -> int:
    """Submit `spec` to the coordinator of the current Ray cluster and follow it to the end; see
    `horizon_ray.cluster.follow.submit_and_follow`."""
    from horizon_ray.cluster.follow import submit_and_follow as _impl

    return _impl(spec, **kwargs)


def should_submit_to_coordinator(environ: dict[str, str] | None = None) -> bool:
    """Whether `horizon-ray finetune` should hand its spec to the coordinator instead of training here;
    see `horizon_ray.cluster.follow.should_submit_to_coordinator`."""
    from horizon_ray.cluster.follow import should_submit_to_coordinator as _impl

    return _impl(environ)


__all__ = [
    "Checkpoint",
    "CoordinatorClient",
    "CoordinatorUnavailable",
    "EventType",
    "HorizonError",
    "IdempotencyConflict",
    "InvalidRequest",
    "InvalidSpec",
    "InvalidTransition",
    "JobError",
    "JobEvent",
    "JobNotFound",
    "JobRecord",
    "JobRejected",
    "JobStatus",
    "LocalClient",
    "NodeInfo",
    "Progress",
    "QuotaExceeded",
    "RayClient",
    "Reservation",
    "TenantQuota",
    "should_submit_to_coordinator",
    "submit_and_follow",
]
