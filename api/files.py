"""Tenant datasets: uploaded through the API, stored in the tenant's own namespace, listed and deleted by it.

``POST /files`` takes the JSONL file as the raw request body (``?filename=train.jsonl&format=auto``),
streams it to disk under the upload limit (413 beyond), checks every line with the data loaders of
``horizon_ray.data`` and keeps it as ``<tenant>/files/file-<id>.jsonl`` next to a small metadata file.
A job spec then names it by id (``data.path: file-...``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from api.auth import Tenant, current_tenant
from api.errors import ApiError
from api.paths import FILE_ID_RE, PathPolicy, read_upload_meta, upload_meta_path
from api.schemas import ERROR_RESPONSES, ErrorBody, FileList, FileObject
from horizon_ray.errors import BadInput

router = APIRouter(tags=["files"])

NDJSON = "application/x-ndjson"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._ -]")
_REFUSED_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def _clean_filename(name: str) -> str:
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = _SAFE_NAME.sub("_", base).strip(" .") or "upload.jsonl"
    return base[:128]


def _data_path(files_dir: Path, file_id: str) -> Path:
    return files_dir / f"{file_id}.jsonl"


def _check_dataset(path: Path, fmt: str, filename: str) -> tuple[str, int]:
    """(detected format, number of examples); BadInput naming the bad line otherwise."""
    from horizon_ray.data.formats import detect_format, load_file

    try:
        examples = load_file(path, fmt)
        detected = detect_format(path) if fmt == "auto" else fmt
    except UnicodeDecodeError:
        raise BadInput(f"{filename}: not UTF-8 text; upload a UTF-8 JSONL file") from None
    except BadInput as exc:
        # The loaders name the file on disk; the tenant knows it by its upload name.
        raise BadInput(str(exc).replace(str(path), filename)) from None
    if not examples:
        raise BadInput(f"{filename}: holds no example; add JSONL lines in alpaca, messages or text format")
    return detected, len(examples)


def _statistics(path: Path, fmt: str, tokenizer_dir: str | None, filename: str) -> dict[str, Any]:
    """What the dataset holds (examples; tokens and a length histogram with a tokenizer)."""
    from horizon_ray.data.stats import dataset_stats

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
    filename: Annotated[str, Query(min_length=1, max_length=255, description="name to show")] = "data.jsonl",
    format: Annotated[str, Query(pattern="^(auto|alpaca|messages|text)$")] = "auto",
    tokenizer: Annotated[str | None, Query(min_length=1, max_length=512, description=(
        "a base model (catalogue name or path under a model root) whose tokenizer counts the tokens: the upload's "
        "stats then hold tokens and a histogram of example lengths"))] = None,
) -> FileObject:
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type in _REFUSED_TYPES:
        raise ApiError(415, "unsupported_media_type",
                       "send the JSONL file as the raw request body (Content-Type: application/x-ndjson), "
                       "not as a form (or use the OpenAI-compatible POST /v1/files, which takes one)")
    meta = await store_upload(tenant, request.stream(), filename, format, tokenizer)
    response.headers["Location"] = f"/files/{meta['id']}"
    return FileObject(**meta)


async def store_upload(tenant: Tenant, chunks: AsyncIterator[bytes], filename: str, format: str,
                       tokenizer: str | None = None) -> dict[str, Any]:
    """Stream an upload to the tenant's files, check every line, keep it with its metadata (the FileObject's
    fields, with the dataset's statistics: its tokens too when `tokenizer` names a base model); ApiError 422
    naming the bad line otherwise. Both upload routes (POST /files, POST /v1/files)."""
    tokenizer_dir = PathPolicy(tenant.settings, tenant.name).model("tokenizer", tokenizer) if tokenizer else None
    files_dir = tenant.files_dir
    await run_in_threadpool(files_dir.mkdir, parents=True, exist_ok=True)
    file_id = f"file-{secrets.token_hex(12)}"
    name = _clean_filename(filename)
    part = files_dir / f".{file_id}.part"
    sha = hashlib.sha256()
    size = 0
    ok = False
    try:
        with open(part, "wb") as out:
            # The body limit middleware raises once the stream passes max_upload_bytes.
            async for chunk in chunks:
                if chunk:
                    size += len(chunk)
                    sha.update(chunk)
                    await run_in_threadpool(out.write, chunk)
        if size == 0:
            raise ApiError(422, "invalid_file", "the upload is empty; send a JSONL file as the body",
                           field="body")
        try:
            detected, count = await run_in_threadpool(_check_dataset, part, format, name)
            stats = await run_in_threadpool(_statistics, part, detected, tokenizer_dir, name)
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
        os.replace(part, _data_path(files_dir, file_id))
        upload_meta_path(files_dir, file_id).write_text(json.dumps(meta))
        ok = True
    finally:
        if not ok:
            part.unlink(missing_ok=True)
    return meta


@router.get("/files", response_model=FileList, summary="List your uploaded datasets",
            responses=ERROR_RESPONSES)
async def list_files(tenant: Annotated[Tenant, Depends(current_tenant)]) -> FileList:
    files_dir = tenant.files_dir

    def scan() -> list[dict[str, Any]]:
        if not files_dir.is_dir():
            return []
        metas = []
        for p in files_dir.glob("file-*.json"):
            meta = read_upload_meta(files_dir, p.stem)
            if meta is not None and _data_path(files_dir, p.stem).is_file():
                metas.append(meta)
        return sorted(metas, key=lambda m: (-m["created_at"], m["id"]))

    return FileList(data=[FileObject(**m) for m in await run_in_threadpool(scan)])


@router.get("/files/{file_id}", response_model=FileObject, summary="One uploaded dataset",
            responses=ERROR_RESPONSES)
async def get_file(file_id: str, tenant: Annotated[Tenant, Depends(current_tenant)]) -> FileObject:
    meta = read_upload_meta(tenant.files_dir, _file_id_or_404(file_id))
    if meta is None:
        raise ApiError(404, "not_found", f"no file {file_id!r}")
    return FileObject(**meta)


@router.get("/files/{file_id}/content", summary="Download an uploaded dataset", response_class=FileResponse,
            responses={**ERROR_RESPONSES, 200: {"content": {NDJSON: {"schema": {"type": "string"}}},
                                                "description": "the JSONL file as uploaded"}})
async def get_file_content(file_id: str, tenant: Annotated[Tenant, Depends(current_tenant)]) -> FileResponse:
    files_dir = tenant.files_dir
    meta = read_upload_meta(files_dir, _file_id_or_404(file_id))
    path = _data_path(files_dir, file_id)
    if meta is None or not path.is_file():
        raise ApiError(404, "not_found", f"no file {file_id!r}")
    return FileResponse(path, media_type=NDJSON, filename=meta["filename"])


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
async def delete_file(file_id: str, tenant: Annotated[Tenant, Depends(current_tenant)]) -> FileObject:
    files_dir = tenant.files_dir
    meta = read_upload_meta(files_dir, _file_id_or_404(file_id))
    if meta is None:
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
