"""Job routes: create, read, list, cancel, events (JSON and server-sent events), checkpoints, outputs.

The routes are mounted under ``/finetune`` (the OpenAI-compatible ``/v1/fine_tuning/jobs`` is ``api.openai``'s).
Every route takes its ``Tenant`` from the one auth dependency, so another tenant's job is a 404 from the
coordinator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from api.auth import Tenant, current_tenant
from api.errors import ApiError
from api.outputs import TarStream
from api.params import EventId, SafePath, SafeText
from api.paths import PathPolicy, confine, confine_spec, safe_relative, single_file
from api.schemas import (
    CANCEL_RESPONSES,
    ERROR_RESPONSES,
    JOB_CREATE_RESPONSES,
    CheckpointList,
    EventList,
    JobList,
    JobObject,
    OutputFile,
    OutputList,
    checkpoint_object,
    event_object,
    job_object,
)
from horizon_ray.cluster.messages import JobEvent, JobStatus
from horizon_ray.jobspec import JobSpec

JOB_ID = Annotated[SafeText, PathParam(min_length=1, max_length=64, description="job id, job-<hex>")]
SPEC_BODY = Annotated[
    JobSpec,
    Body(openapi_examples={"tiny": {"summary": "a small run", "value": {
             "model": {"path": "tiny-llama"}, "data": {"path": "file-0123456789abcdef01234567"},
             "training": {"max_steps": 20, "lr": 1e-4, "seq_len": 128}}}}),
]
SSE_MEDIA = "text/event-stream"
OCTETS = "application/octet-stream"
# the output files a browser may show as they are (never HTML or SVG: a job's files are not the API's pages)
OUTPUT_MEDIA = {".png": "image/png", ".json": "application/json", ".jsonl": "application/x-ndjson",
                ".yaml": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
MAX_SEQ = 2**62  # event sequence numbers fit the job store's 64-bit integers


def checked_spec(tenant: Tenant, spec: JobSpec) -> dict[str, Any]:
    """The spec as the tenant wrote it (the keys given), with its paths confined to what the tenant may read
    (422 naming the field otherwise). Its shape was checked by the route; the coordinator checks the rest
    (InvalidSpec -> 422 naming the field)."""
    return confine_spec(spec.model_dump(exclude_unset=True), PathPolicy(tenant.settings, tenant.name))


def job_routes(base: str) -> APIRouter:
    """The job routes under `base` (e.g. "/finetune")."""
    router = APIRouter(prefix=base, tags=["jobs"])

    @router.post("", status_code=201, response_model=JobObject, responses=JOB_CREATE_RESPONSES,
                 summary="Create a fine-tuning job")
    async def create_job(
        spec: SPEC_BODY,
        response: Response,
        tenant: Annotated[Tenant, Depends(current_tenant)],
        idempotency_key: Annotated[SafeText | None, Header(alias="Idempotency-Key", min_length=1, max_length=255,
                                                      description="a retried create with the same key "
                                                                  "returns the same job")] = None,
        priority: Annotated[int, Query(ge=-1000, le=1000, description="higher runs first among your "
                                                                      "queued jobs")] = 0,
    ) -> JobObject:
        record = await tenant.submit(checked_spec(tenant, spec), idempotency_key=idempotency_key,
                                    priority=priority)
        response.headers["Location"] = f"{base}/{record.id}"
        return job_object(record, base)

    @router.get("", response_model=JobList, responses=ERROR_RESPONSES, summary="List your jobs, newest first")
    async def list_jobs(
        tenant: Annotated[Tenant, Depends(current_tenant)],
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: Annotated[SafeText | None, Query(min_length=1, max_length=64,
                                           description="id of the last job of the previous page")] = None,
        status: Annotated[JobStatus | None, Query(description="only jobs in this state")] = None,
    ) -> JobList:
        records, has_more = await tenant.list(limit=limit, after=after, status=status)
        data = [job_object(r, base) for r in records]
        return JobList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                       last_id=data[-1].id if data else None)

    @router.get("/{job_id}", response_model=JobObject, responses=ERROR_RESPONSES, summary="One job")
    async def get_job(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)]) -> JobObject:
        return job_object(await tenant.get(job_id), base)

    @router.post("/{job_id}/cancel", response_model=JobObject, responses=CANCEL_RESPONSES,
                 summary="Cancel a job (queued: at once; running: once its engine stopped)")
    async def cancel_job(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)]) -> JobObject:
        return job_object(await tenant.cancel(job_id), base)

    @router.get(
        "/{job_id}/events",
        response_model=EventList,
        responses={**ERROR_RESPONSES, 200: {"content": {SSE_MEDIA: {"schema": {"type": "string"}}},
                                             "description": "JSON list, or with `Accept: text/event-stream` "
                                                            "a stream of typed events (status, metrics, "
                                                            "checkpoint, memory, error, then end)"}},
        summary="A job's events, as a JSON page or a server-sent-events stream",
    )
    async def job_events(
        request: Request,
        job_id: JOB_ID,
        tenant: Annotated[Tenant, Depends(current_tenant)],
        after: Annotated[int, Query(ge=0, le=MAX_SEQ, description="only events with seq > after")] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        last_event_id: Annotated[EventId | None, Header(alias="Last-Event-ID", max_length=32,
                                                        include_in_schema=False)] = None,
    ):
        if SSE_MEDIA in request.headers.get("accept", ""):
            record = await tenant.get(job_id)  # 404 as JSON before the stream starts
            # A resumed stream starts after the client's last event, but never past the job's newest one: the
            # stream (and its end event) only ever names events that exist.
            start = min(max(after, int(last_event_id or 0)), record.last_seq)
            close = request.app.state.limits.open_stream(tenant.name)  # 429 beyond the tenant's streams
            try:
                stream = request.app.state.hub.stream(request, tenant.name, job_id, start,
                                                      tenant.settings.sse_heartbeat_s)
                return ClosingStream(stream, close, media_type=SSE_MEDIA,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            except BaseException:
                close()
                raise
        events: list[JobEvent] = await tenant.events(job_id, after, limit + 1)  # one more: is there more?
        page = events[:limit]
        return EventList(data=[event_object(e) for e in page], has_more=len(events) > limit,
                         last_seq=page[-1].seq if page else after)

    @router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses=ERROR_RESPONSES,
                summary="A job's complete checkpoints, oldest first")
    async def job_checkpoints(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)]) -> CheckpointList:
        return CheckpointList(data=[checkpoint_object(c) for c in await tenant.checkpoints(job_id)])

    @router.get("/{job_id}/outputs", response_model=OutputList, responses=ERROR_RESPONSES,
                summary="Files under a job's output directory (checkpoints, final model, metrics)")
    async def job_outputs(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)]) -> OutputList:
        root = await _output_root(tenant, job_id)
        files = await run_in_threadpool(_walk_outputs, root) if root is not None else []
        return OutputList(job_id=job_id, data=files)

    @router.get("/{job_id}/outputs/final.tar", response_class=StreamingResponse,
                responses={**ERROR_RESPONSES, 200: {"content": {"application/x-tar": {"schema": {
                    "type": "string", "format": "binary"}}}, "description": "final/ as a tar, streamed"}},
                summary="Download a finished job's model (its final/ directory) in one request")
    async def job_final_tar(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)]) -> StreamingResponse:
        root = await _output_root(tenant, job_id)
        final = confine(root / "final", root) if root is not None else None
        if final is None or not final.is_dir():
            raise ApiError(404, "not_found", f"job {job_id} has no final model yet (it is written when the job "
                           "succeeds); its checkpoints are under .../outputs")
        archive = await run_in_threadpool(TarStream, final, f"{job_id}-final")
        return StreamingResponse(iter(archive), media_type="application/x-tar", headers={
            "Content-Length": str(archive.length),
            "Content-Disposition": f'attachment; filename="{job_id}-final.tar"'})

    @router.get("/{job_id}/outputs/{path:path}", response_class=FileResponse,
                responses={**ERROR_RESPONSES, 200: {"content": {OCTETS: {"schema": {"type": "string",
                                                                                    "format": "binary"}}},
                                                    "description": "the file's bytes"}},
                summary="Download one file of a job's outputs")
    async def job_output_file(
        job_id: JOB_ID, path: SafePath, tenant: Annotated[Tenant, Depends(current_tenant)]
    ) -> FileResponse:
        root = await _output_root(tenant, job_id)
        try:
            rel = safe_relative("path", path)
        except ApiError:
            raise ApiError(404, "not_found", "no such output file") from None
        target = confine(root / rel, root) if root is not None and is_output(rel) else None
        if target is None or not single_file(target):  # a hard link may be another file's second name
            raise ApiError(404, "not_found", "no such output file")
        # its own type where it has one (loss_curve.png an image the browser shows; JSON, JSONL, text), else bytes
        media = OUTPUT_MEDIA.get(target.suffix, OCTETS)
        return FileResponse(target, media_type=media, filename=target.name,
                            content_disposition_type="inline" if media != OCTETS else "attachment")

    return router


async def _output_root(tenant: Tenant, job_id: str) -> Path | None:
    """The job's output directory, resolved, when it exists inside the tenant's namespace."""
    record = await tenant.get(job_id)
    root = PathPolicy(tenant.settings, tenant.name).owns_output(record.output_dir or record.spec.get("output_dir"))
    return root if root is not None and root.is_dir() else None


def is_output(rel: PurePosixPath) -> bool:
    """Whether a path under a job's output directory is one of its outputs: not the engine's bookkeeping (.lock,
    .lease, .lease.lock: dot-names) and not a write in progress (<name>.tmp-<pid>, horizon_ray.atomic)."""
    return not any(part.startswith(".") or ".tmp-" in part for part in rel.parts)


def _walk_outputs(root: Path) -> list[OutputFile]:
    files: list[OutputFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if is_output(PurePosixPath(d)))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if not is_output(PurePosixPath(name)):
                continue
            if confine(p, root) is None or not single_file(p):  # a symlink out, or a hard link: no output
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            files.append(OutputFile(path=p.relative_to(root).as_posix(), bytes=st.st_size,
                                    modified_at=st.st_mtime))
    return files


class ClosingStream(StreamingResponse):
    """A streaming response that calls `on_close` however it ends (sent whole, client gone, error): it
    releases the stream's slot among its tenant's (api.quotas)."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
