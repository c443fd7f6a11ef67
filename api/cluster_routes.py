"""Cluster routes: the dry-run plan, the nodes with their RAM ledger, the queue; health, readiness, metrics."""

from __future__ import annotations

import shutil
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from api.auth import Tenant, current_tenant
from api.errors import DISK_FULL_RETRY_S, error_response
from api.jobs import SPEC_BODY, checked_spec
from api.schemas import (
    ERROR_RESPONSES,
    Health,
    NodeList,
    PlanResponse,
    QueueEntry,
    QueueObject,
    json_safe,
    node_object,
)

router = APIRouter(tags=["cluster"])
health = APIRouter(tags=["health"])


@router.post("/plan", response_model=PlanResponse, responses=ERROR_RESPONSES,
             summary="Dry run: the memory plan and the candidate nodes for a spec, without creating a job")
async def plan(spec: SPEC_BODY, tenant: Annotated[Tenant, Depends(current_tenant)]) -> PlanResponse:
    return PlanResponse(**json_safe(await tenant.plan(checked_spec(tenant, spec))))


@router.get("/nodes", response_model=NodeList, responses=ERROR_RESPONSES,
            summary="Nodes with RAM, GPUs and reservation ledger (other tenants' jobs anonymised)")
async def nodes(tenant: Annotated[Tenant, Depends(current_tenant)]) -> NodeList:
    infos = await tenant.nodes()
    mine = {r.job_id for n in infos for r in n.ledger if r.tenant == tenant.name}
    return NodeList(data=[node_object(n, mine) for n in infos])


@router.get("/queue", response_model=QueueObject, responses=ERROR_RESPONSES,
            summary="Your waiting jobs in serving order, and how many jobs wait in all")
async def queue(tenant: Annotated[Tenant, Depends(current_tenant)]) -> QueueObject:
    own = await tenant.queue()
    return QueueObject(
        total_waiting=await tenant.waiting(),
        data=[QueueEntry(id=r.id, name=r.name, status=r.status, position=r.queue_position,
                         reason=r.queue_reason, priority=r.priority, created_at=r.created_at) for r in own],
    )


@health.get("/healthz", response_model=Health, summary="The API process is up")
async def healthz() -> Health:
    return Health(status="ok")


@health.get("/readyz", response_model=Health, responses={503: ERROR_RESPONSES[503]},
            summary="The coordinator answers and has loaded its job table")
async def readyz(request: Request):
    try:
        ready = bool(await run_in_threadpool(request.app.state.client.ready))
    except Exception:
        ready = False
    if not ready:
        return error_response(503, "unavailable", "the coordinator is not ready")
    full = await run_in_threadpool(storage_full, request.app.state.settings)
    if full:  # uploads and job outputs would fail with 507: a load balancer sends requests elsewhere
        return error_response(503, "unavailable", full, headers={"Retry-After": str(DISK_FULL_RETRY_S)})
    return Health(status="ready")


MIN_FREE_BYTES = 64 << 20  # below this on the uploads' or the jobs' filesystem the service is not ready


def storage_full(settings) -> str | None:
    """Why the service's storage cannot take writes (its uploads' or jobs' filesystem has less than
    MIN_FREE_BYTES free), or None."""
    for what, path in (("uploads", settings.uploads_dir), ("job outputs", settings.jobs_root)):
        while not path.exists() and path != path.parent:  # not made yet: the filesystem it will be made on
            path = path.parent
        try:
            free = shutil.disk_usage(path).free
        except OSError:
            continue
        if free < MIN_FREE_BYTES:
            return f"the service's storage for {what} is full ({free} bytes free); retry later"
    return None


@health.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    if not request.app.state.settings.metrics_open:  # it counts every tenant's jobs: a key's holders only
        await current_tenant(request)
    body = await run_in_threadpool(generate_latest, request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
