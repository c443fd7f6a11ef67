"""Tenant datasets: uploaded through the API, stored in the tenant's own namespace, listed and deleted by it.

``POST /files`` takes the JSONL file as the raw request body (``?filename=train.jsonl&format=auto``),
streams it to disk under the upload limit (413 beyond), checks every line as it arrives with the rules of the
data loaders of ``horizon_ray.data`` (``LineChecker``: nothing but the line being read is kept, so an upload
costs this process the same memory whatever its size) and keeps it as ``<tenant>/file-<id>.jsonl`` next to a
small metadata file. A job spec then names it by id (``data.path: file-...``). A tenant's uploads in flight,
files and bytes kept are limited (settings ``max_uploads_in_flight``, ``max_files_per_tenant``,
``max_file_bytes_per_tenant``; 429 beyond). The metadata holds what the dataset holds (examples; with
``?tokenizer=<base model>`` its tokens and a histogram of example lengths). The OpenAI-compatible
``POST /v1/files`` (``api.openai``, a multipart form) stores through the same ``store_upload``.

Nothing here follows a symbolic link: the tenant's directory must be a plain directory where the settings say,
files are created and opened with O_NOFOLLOW, and a link planted under a file's name is no file.

An upload in flight is a ``.file-<id>.part`` file; its bytes count against the tenant's quota like a kept file's
(also another API process's uploads, and one left by a server killed mid-upload). A part untouched for
``STALE_UPLOAD_S`` belongs to no live upload: it is swept when the app starts and before each upload of its
tenant.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import Tenant, current_tenant
from api.errors import ApiError
from api.params import FileName, SafePath, SafeText
from api.paths import (
    FILE_ID_RE,
    PathPolicy,
    open_regular,
    own_files_dir,
    read_upload_meta,
    regular_file,
    upload_dir,
    upload_meta_path,
)
from api.quotas import TenantLimits
from api.schemas import ERROR_RESPONSES, ErrorBody, FileList, FileObject
from horizon_ray.atomic import write_atomic
from horizon_ray.data.formats import FORMATS, LineChecker
from horizon_ray.errors import BadInput

router = APIRouter(tags=["files"])
log = logging.getLogger("horizon_ray.api")
# A part file untouched this long belongs to no live upload: a live one is written at least once every
# BODY_IDLE_TIMEOUT_S (api.limits), or the server drops it.
STALE_UPLOAD_S = 600.0

NDJSON = "application/x-ndjson"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._ -]")
_REFUSED_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def _clean_filename(name: str) -> str:
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = _SAFE_NAME.sub("_", base).strip(" .") or "upload.jsonl"
    return base[:128]


def _data_path(files_dir: Path, file_id: str) -> Path:
    return files_dir / f"{file_id}.jsonl"


def _statistics(path: Path, fmt: str, count: int, tokenizer_dir: str | None, filename: str) -> dict[str, Any]:
    """What the dataset holds: its format and examples (as the upload's check counted them); with a tokenizer
    also its tokens and a histogram of example lengths, read from the stored file an example at a time."""
    from horizon_ray.data.stats import DatasetStats, dataset_stats

    if tokenizer_dir is None:
        return DatasetStats(format=fmt, examples=count).to_dict()
    try:
        return dataset_stats(path, fmt, tokenizer_dir).to_dict()
    except BadInput as exc:
        raise BadInput(str(exc).replace(str(path), filename)) from None


def _file_id_or_404(file_id: str) -> str:
    if not FILE_ID_RE.fullmatch(file_id):
        raise ApiError(404, "not_found", f"no file {file_id!r}")
    return file_id


@router.post(
    "/files",
    status_code=201,
    response_model=FileObject,
    summary="Upload a JSONL dataset (raw request body)",
    responses={**ERROR_RESPONSES, 415: {"model": ErrorBody, "description": "sent as a form, not a raw body"}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                NDJSON: {"schema": {"type": "string", "format": "binary"}},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
)
async def upload_file(
    request: Request,
    response: Response,
    tenant: Annotated[Tenant, Depends(current_tenant)],
    filename: Annotated[FileName, Query(min_length=1, description="name to show")] = "data.jsonl",
    format: Annotated[str, Query(pattern=f"^({'|'.join(FORMATS)})$")] = "auto",
    tokenizer: Annotated[SafePath | None, Query(min_length=1, max_length=512, description=(
        "a base model (catalogue name or path under a model root) whose tokenizer counts the tokens: the upload's "
        "stats then hold tokens and a histogram of example lengths"))] = None,
) -> FileObject:
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type in _REFUSED_TYPES:
        raise ApiError(415, "unsupported_media_type",
                       "send the JSONL file as the raw request body (Content-Type: application/x-ndjson), "
                       "not as a form (or use the OpenAI-compatible POST /v1/files, which takes one)")
    meta = await store_upload(request.app.state.limits, tenant, request.stream(), filename, format, tokenizer)
    response.headers["Location"] = f"/files/{meta['id']}"
    return FileObject(**meta)


async def store_upload(limits: TenantLimits, tenant: Tenant, chunks: AsyncIterator[bytes], filename: str,
                       format: str, tokenizer: str | None = None) -> dict[str, Any]:
    """Stream an upload to the tenant's files, checking every line as it arrives (``LineChecker``: memory stays
    within one line whatever the file's size), within the tenant's limits (uploads in flight, files and bytes
    kept: 429 beyond), and keep it with its metadata (the FileObject's fields, with the dataset's statistics:
    its tokens too when `tokenizer` names a base model); ApiError 422 naming the bad line otherwise. Both upload
    routes (POST /files, POST /v1/files)."""
    settings = tenant.settings
    tokenizer_dir = PathPolicy(settings, tenant.name).model("tokenizer", tokenizer) if tokenizer else None
    with limits.upload(tenant.name):  # 429 beyond the tenant's uploads in flight
        files_dir = await run_in_threadpool(upload_dir, settings, tenant.name)
        await run_in_threadpool(_sweep_parts, files_dir, time.time() - STALE_UPLOAD_S)
        stored = await run_in_threadpool(_stored, files_dir)
        if len(stored) >= settings.max_files_per_tenant:
            raise ApiError(429, "quota_exceeded", f"you keep {len(stored)} uploaded files, the limit (setting "
                           "max_files_per_tenant); delete some with DELETE /files/{id}",
                           headers={"Retry-After": "60"})
        # what it keeps, and what its other uploads in flight have written so far
        held = sum(int(m.get("bytes") or 0) for m in stored) + await run_in_threadpool(_part_bytes, files_dir)
        room = settings.max_file_bytes_per_tenant - held
        file_id = f"file-{secrets.token_hex(12)}"
        name = _clean_filename(filename)
        checker = LineChecker(format, name, settings.max_upload_line_bytes)
        part = files_dir / f".{file_id}.part"
        sha = hashlib.sha256()
        size = 0
        ok = False
        # never through a link: a name planted in the directory cannot redirect the write
        fd = await run_in_threadpool(os.open, part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
        try:
            try:
                # The body limit middleware raises once the stream passes max_upload_bytes. Each chunk is
                # written and checked as it comes (LineChecker keeps only the line being read), on a worker
                # thread: the file's size never shows in this process's memory.
                async for chunk in chunks:
                    if not chunk:
                        continue
                    size += len(chunk)
                    if size > room:
                        raise ApiError(429, "quota_exceeded",
                                       f"this upload would take your uploaded files past "
                                       f"{settings.max_file_bytes_per_tenant} bytes, the limit (setting "
                                       "max_file_bytes_per_tenant); delete some with DELETE /files/{id}",
                                       headers={"Retry-After": "60"})
                    sha.update(chunk)
                    await run_in_threadpool(_write_and_check, fd, chunk, checker)
                if size == 0:
                    raise ApiError(422, "invalid_file", "the upload is empty; send a JSONL file as the body",
                                   field="body")
                detected, count = await run_in_threadpool(checker.finish)
            except BadInput as exc:
                raise ApiError(422, "invalid_file", str(exc), field="body") from None
            finally:
                os.close(fd)
            try:
                stats = await run_in_threadpool(_statistics, part, detected, count, tokenizer_dir, name)
            except BadInput as exc:
                raise ApiError(422, "invalid_file", str(exc), field="body") from None
            meta = {
                "id": file_id,
                "object": "file",
                "filename": name,
                "bytes": size,
                "created_at": time.time(),
                "format": detected,
                "num_examples": count,
                "sha256": sha.hexdigest(),
                "stats": stats,
            }
            os.replace(part, _data_path(files_dir, file_id))  # a rename replaces a link, never follows it
            await run_in_threadpool(write_atomic, upload_meta_path(files_dir, file_id), json.dumps(meta).encode())
            ok = True
        finally:
            if not ok:
                _unlink(part)
                _unlink(_data_path(files_dir, file_id))
    return meta


def _write_and_check(fd: int, chunk: bytes, checker: LineChecker) -> None:
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]
    checker.feed(chunk)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _part_files(files_dir: Path) -> list[tuple[Path, os.stat_result]]:
    """The part files of the uploads in flight (or left behind), each with its lstat; links are no part."""
    out = []
    for p in files_dir.glob(".file-*.part"):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((p, st))
    return out


def _part_bytes(files_dir: Path) -> int:
    return sum(st.st_size for _, st in _part_files(files_dir))


def _sweep_parts(files_dir: Path, untouched_since: float) -> int:
    """Delete the part files not written since `untouched_since` (a time.time()); returns how many."""
    swept = 0
    for p, st in _part_files(files_dir):
        if st.st_mtime < untouched_since:
            _unlink(p)
            swept += 1
    return swept


def sweep_stale_uploads(settings: Any, now: float | None = None) -> int:
    """At start: delete every tenant's part files untouched for STALE_UPLOAD_S (a server killed mid-upload
    left them; nothing finishes them). Only plain tenant directories are read (never through a link)."""
    root = settings.uploads_dir
    if not root.is_dir():
        return 0
    cutoff = (time.time() if now is None else now) - STALE_UPLOAD_S
    swept = 0
    for entry in os.scandir(root):
        files_dir = own_files_dir(settings, entry.name) if entry.is_dir(follow_symlinks=False) else None
        if files_dir is not None:
            swept += _sweep_parts(files_dir, cutoff)
    if swept:
        log.info("swept %d stale upload part file(s) under %s", swept, root)
    return swept


def _stored(files_dir: Path) -> list[dict[str, Any]]:
    """What the tenant keeps uploaded: the metadata of every complete upload, newest first."""
    if not files_dir.is_dir():
        return []
    metas = []
    for p in files_dir.glob("file-*.json"):
        meta = read_upload_meta(files_dir, p.stem)
        if meta is not None and regular_file(_data_path(files_dir, p.stem)):
            metas.append(meta)
    return sorted(metas, key=lambda m: (-m["created_at"], m["id"]))


@router.get("/files", response_model=FileList, summary="List your uploaded datasets",
            responses=ERROR_RESPONSES)
async def list_files(tenant: Annotated[Tenant, Depends(current_tenant)]) -> FileList:
    files_dir = await run_in_threadpool(own_files_dir, tenant.settings, tenant.name)
    stored = await run_in_threadpool(_stored, files_dir) if files_dir is not None else []
    return FileList(data=[FileObject(**m) for m in stored])


@router.get("/files/{file_id}", response_model=FileObject, summary="One uploaded dataset",
            responses=ERROR_RESPONSES)
async def get_file(file_id: SafeText, tenant: Annotated[Tenant, Depends(current_tenant)]) -> FileObject:
    files_dir = own_files_dir(tenant.settings, tenant.name)
    meta = read_upload_meta(files_dir, _file_id_or_404(file_id)) if files_dir is not None else None
    if meta is None:
        raise ApiError(404, "not_found", f"no file {file_id!r}")
    return FileObject(**meta)


@router.get("/files/{file_id}/content", summary="Download an uploaded dataset", response_class=StreamingResponse,
            responses={**ERROR_RESPONSES, 200: {"content": {NDJSON: {"schema": {"type": "string"}}},
                                                "description": "the JSONL file as uploaded"}})
async def get_file_content(file_id: SafeText,
                           tenant: Annotated[Tenant, Depends(current_tenant)]) -> StreamingResponse:
    files_dir = own_files_dir(tenant.settings, tenant.name)
    meta = read_upload_meta(files_dir, _file_id_or_404(file_id)) if files_dir is not None else None
    opened = open_regular(_data_path(files_dir, file_id)) if files_dir is not None and meta is not None else None
    if meta is None or opened is None:
        raise ApiError(404, "not_found", f"no file {file_id!r}")
    fd, size = opened
    name = _clean_filename(str(meta.get("filename") or "data.jsonl"))
    return StreamingResponse(_chunks(fd), media_type=NDJSON, headers={
        "Content-Length": str(size), "Content-Disposition": f'attachment; filename="{name}"'})


def _chunks(fd: int):
    """The bytes of an open file, then it is closed (the response reads it on a worker thread)."""
    try:
        while chunk := os.read(fd, 1 << 20):
            yield chunk
    finally:
        os.close(fd)


async def _live_jobs(tenant: Tenant) -> list:
    """Every job of the tenant that has not ended (all pages)."""
    out, after = [], None
    while True:
        jobs, more = await tenant.list(limit=1000, after=after)
        out += [j for j in jobs if not j.status.is_terminal()]
        if not more or not jobs:
            return out
        after = jobs[-1].id


@router.delete("/files/{file_id}", response_model=FileObject, summary="Delete an uploaded dataset",
               responses={**ERROR_RESPONSES, 409: {**ERROR_RESPONSES[422],
                                                   "description": "a job that has not ended uses the file"}})
async def delete_file(file_id: SafeText, tenant: Annotated[Tenant, Depends(current_tenant)]) -> FileObject:
    files_dir = own_files_dir(tenant.settings, tenant.name)
    meta = read_upload_meta(files_dir, _file_id_or_404(file_id)) if files_dir is not None else None
    if files_dir is None or meta is None:
        raise ApiError(404, "not_found", f"no file {file_id!r}")
    path = str(_data_path(files_dir, file_id))
    for job in await _live_jobs(tenant):
        data = (job.spec or {}).get("data") or {}
        if path in (data.get("path"), data.get("eval_path")):
            # a queued job reads it when it starts, a running one again when it resumes after a failure
            raise ApiError(409, "file_in_use", f"file {file_id} is the dataset of job {job.id}, which has not "
                           f"ended ({job.status.value}); cancel the job or wait for it to end, then delete")
    _data_path(files_dir, file_id).unlink(missing_ok=True)
    upload_meta_path(files_dir, file_id).unlink(missing_ok=True)
    return FileObject(**{**meta, "deleted": True})
