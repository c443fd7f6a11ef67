"""The OpenAI-compatible API under ``/v1``: the ``openai`` Python SDK works against it unchanged.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    f = client.files.create(file=open("train.jsonl", "rb"), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="qwen2.5-7b-instruct", training_file=f.id,
                                         hyperparameters={"n_epochs": 2}, suffix="support-bot")
    client.fine_tuning.jobs.retrieve(job.id); client.fine_tuning.jobs.list_events(job.id)

Routes (OpenAI's paths, object names, statuses, list pagination and error shape): ``/files`` (multipart upload
with purpose ``fine-tune``, list, retrieve, delete, content), ``/fine_tuning/jobs`` (create, list with an
``after`` cursor, retrieve, cancel, events newest first, checkpoints) and ``/models`` (list and retrieve: the
operator's catalogue, HORIZON_MODEL_CATALOGUE, and the tenant's fine-tuned models, ``ft:`` names of its succeeded
jobs whose final/ is on the service's storage: what ``/chat/completions`` serves). A job created here is an
ordinary job of the service (the same coordinator, plan, events and outputs under ``/finetune/{id}``); jobs
created there show here too.

How OpenAI's parameters map onto a job spec:
- ``model``: a catalogue name (refused otherwise, with the names there are); ``training_file`` /
  ``validation_file``: file ids of ``POST /v1/files`` (or ``POST /files``); without a validation file nothing is
  held out (``data.eval_fraction`` 0);
- ``hyperparameters`` (or ``method.supervised.hyperparameters``): ``n_epochs`` -> ``training.epochs`` (auto:
  ``AUTO_EPOCHS``); ``batch_size`` -> examples per optimizer step, unpacked (``training.micro_batch_size``,
  ``training.packing`` false; auto: the spec's packed rows); ``learning_rate_multiplier`` -> ``training.lr`` x
  the multiplier (auto: 1);
- ``method`` ``{"type": "dpo", "dpo": {"hyperparameters": {...}}}``: ``objective: dpo`` on OpenAI's preference
  format (``input``, ``preferred_output``, ``non_preferred_output``); ``beta`` -> ``dpo.beta`` (auto: 0.1), the
  others as above, ``batch_size`` counting pairs (two rows each);
- ``suffix`` -> the job's name; ``seed`` -> ``training.seed``; ``method.type`` is ``supervised`` or ``dpo``;
  ``integrations`` of type ``wandb`` -> ``integrations.wandb``;
- ``spec`` (an extension, ``extra_body={"spec": {...}}`` in the SDK): any other job spec fields (seq_len, LoRA,
  the engine), under the mapped ones.
Statuses: validating -> ``validating_files``; queued and recovering -> ``queued``; running, checkpointing and
cancelling -> ``running`` (a cancel is ``cancelled`` once the engine has stopped); the final ones as they are.
A finished job's ``fine_tuned_model`` is ``ft:<model>:<tenant>:<suffix>:<job id>``; its files download from
``/finetune/{id}/outputs`` (``outputs_url``, and ``final.tar`` in one request).
Errors are ``{"error": {"message", "type", "param", "code"}}``; a request the API refuses as invalid is a 400
(``invalid_request_error``), as OpenAI answers it.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, FastAPI, File, Form, Header, Query, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api import files
from api.auth import Tenant, current_tenant
from api.errors import ApiError, SafeJSONResponse
from api.jobs import JOB_ID, checked_spec
from api.params import SafePath, SafeText
from api.paths import FILE_ID_RE, PathPolicy, confine
from api.settings import ENV_MODEL_CATALOGUE
from horizon_ray.cluster.errors import JobNotFound
from horizon_ray.cluster.messages import Checkpoint, EventType, JobEvent, JobRecord, JobStatus
from horizon_ray.errors import BadInput
from horizon_ray.job.metrics import METRICS_FILE
from horizon_ray.job.progress import format_rewards
from horizon_ray.jobspec import DpoSpec, JobSpec, Quantize, Text, TrainingSpec, spec_error
from horizon_ray.strings import MAX_COMPONENT_BYTES, fix, problem

PREFIX = "/v1"
AUTO_EPOCHS = 3  # n_epochs "auto": three passes, OpenAI's usual choice for small datasets
# checkpoint.every_steps and keep of a job created here unless its spec says: OpenAI keeps the newest three
# checkpoints, and a node that dies then costs at most this many steps
CHECKPOINT_EVERY, CHECKPOINT_KEEP = 100, 3
# a job's result file (its metrics.jsonl) is file-<the job id's 12 hex digits><RESULT_TAG>: found from the id
RESULT_TAG = "0" * 12
UPLOAD_CHUNK = 1 << 20

STATUS = {
    JobStatus.VALIDATING: "validating_files", JobStatus.QUEUED: "queued", JobStatus.RECOVERING: "queued",
    JobStatus.RUNNING: "running", JobStatus.CHECKPOINTING: "running", JobStatus.CANCELLING: "running",
    JobStatus.SUCCEEDED: "succeeded", JobStatus.FAILED: "failed", JobStatus.CANCELLED: "cancelled",
}



class OpenAIErrorDetail(BaseModel):
    message: str = Field(description="one human-readable sentence")
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error, server_error")
    param: str | None = Field(None, description="the parameter (or dotted job spec field) to blame")
    code: str | None = Field(None, description="stable machine-readable code, e.g. model_not_found")


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": OpenAIError, "description": what} for status, what in (
        (400, "invalid request; `param` names the offending parameter"), (401, "missing or invalid API key"),
        (404, "no such resource for this tenant"), (409, "the job already finished, or the file is in use"),
        (413, "request body larger than the limit"), (415, "unsupported media type"),
        (429, "the tenant's quota forbids it"), (500, "internal error"), (503, "the coordinator is unavailable"))}

router = APIRouter(prefix=PREFIX, tags=["openai"], responses=ERRORS)


# ---- request bodies ---------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hyperparameters(_Strict):
    n_epochs: Literal["auto"] | int | None = Field(None, ge=1)
    batch_size: Literal["auto"] | int | None = Field(None, ge=1)
    learning_rate_multiplier: Literal["auto"] | float | None = Field(None, gt=0)
    # horizon-ray's: LoRA on a quantized base (QLoRA: nf4), spec method lora + lora.quantize
    quantize: Quantize | None = None


class Supervised(_Strict):
    hyperparameters: Hyperparameters | None = None


class DpoHyperparameters(Hyperparameters):
    beta: Literal["auto"] | float | None = Field(None, gt=0)


class Dpo(_Strict):
    hyperparameters: DpoHyperparameters | None = None


class Method(_Strict):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: Supervised | None = None
    dpo: Dpo | None = None
    reinforcement: dict[str, Any] | None = None


class Wandb(_Strict):
    project: Text
    entity: Text | None = None
    name: Text | None = None
    tags: list[Text] = Field(default_factory=list)


class Integration(_Strict):
    type: Literal["wandb"]
    wandb: Wandb


# Every string of a create request is checked like a job spec's (horizon_ray.strings, via jobspec.Text): no
# unpaired surrogate, no control character, a bounded length.
class CreateJob(_Strict):
    model: Text = Field(min_length=1, max_length=256)
    training_file: Text = Field(min_length=1, max_length=64)
    validation_file: Text | None = Field(None, max_length=64)
    hyperparameters: Hyperparameters | None = None
    suffix: Text | None = Field(None, min_length=1, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    method: Method | None = None
    integrations: list[Integration] | None = None
    metadata: dict[Text, Text] | None = None
    spec: dict[str, Any] | None = None  # horizon-ray's extension: other job spec fields


# ---- files ------------------------------------------------------------------------------------------------


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    """An upload's metadata as OpenAI's `file` object (with horizon-ray's checked format and statistics)."""
    out = {"id": meta["id"], "object": "file", "bytes": meta["bytes"], "created_at": int(meta["created_at"]),
           "filename": meta["filename"], "purpose": "fine-tune", "status": "processed", "status_details": None,
           "expires_at": None}
    out.update({k: meta[k] for k in ("format", "num_examples", "stats") if k in meta})
    return out


async def _chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(UPLOAD_CHUNK):
        yield chunk


@router.post("/files", status_code=200, summary="Upload a JSONL dataset (OpenAI: multipart, purpose fine-tune)")
async def create_file(request: Request, tenant: Annotated[Tenant, Depends(current_tenant)],
                      file: Annotated[UploadFile, File()],
                      purpose: Annotated[SafeText, Form()],
                      tokenizer: Annotated[SafePath | None, Form(max_length=512, description=(
                          "horizon-ray's extension (extra_body in the SDK): a catalogue model whose tokenizer "
                          "counts the file's tokens"))] = None) -> dict[str, Any]:
    if purpose != "fine-tune":
        raise ApiError(400, "invalid_purpose", f"purpose {purpose!r} is not served here; this API takes training "
                       "data: purpose 'fine-tune'", field="purpose")
    filename = file.filename or "data.jsonl"
    bad = problem(filename, max_bytes=MAX_COMPONENT_BYTES)  # the form's file name: checked like POST /files's
    if bad:
        raise ApiError(400, "invalid_request", f"file's filename {bad}; {fix(bad)}", field="file")
    # The form was spooled to a temporary file as it came (Starlette, under the upload limit); it is checked
    # and stored as POST /files stores a raw body: a line at a time, within the tenant's upload limits.
    meta = await files.store_upload(request.app.state.limits, tenant, _chunks(file), filename, "auto", tokenizer)
    return file_object(meta)


@router.get("/files", summary="List your files (OpenAI)")
async def list_files(tenant: Annotated[Tenant, Depends(current_tenant)],
                     purpose: Annotated[SafeText | None, Query(max_length=64)] = None,
                     limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
                     order: Annotated[Literal["asc", "desc"], Query()] = "desc",
                     after: Annotated[SafeText | None, Query(max_length=64)] = None) -> dict[str, Any]:
    metas = [m.model_dump() for m in (await files.list_files(tenant)).data]  # newest first
    if purpose not in (None, "fine-tune"):
        metas = []
    if order == "asc":
        metas.reverse()
    if after is not None:
        ids = [m["id"] for m in metas]
        metas = metas[ids.index(after) + 1:] if after in ids else []
    page = [file_object(m) for m in metas[:limit]]
    return _page(page, has_more=len(metas) > limit)


@router.get("/files/{file_id}", summary="One file (OpenAI): an upload, or a job's result file")
async def retrieve_file(file_id: SafeText, tenant: Annotated[Tenant, Depends(current_tenant)]) -> dict[str, Any]:
    if (job_id := result_job_id(file_id)) is not None:
        path, record = await _result_path(tenant, job_id, file_id)
        return {"id": file_id, "object": "file", "bytes": path.stat().st_size, "created_at": int(record.created_at),
                "filename": METRICS_FILE, "purpose": "fine-tune-results", "status": "processed",
                "status_details": None, "expires_at": None}
    return file_object((await files.get_file(file_id, tenant)).model_dump())


@router.delete("/files/{file_id}", summary="Delete a file (OpenAI)")
async def delete_file(file_id: SafeText, tenant: Annotated[Tenant, Depends(current_tenant)]) -> dict[str, Any]:
    await files.delete_file(file_id, tenant)
    return {"id": file_id, "object": "file", "deleted": True}


@router.get("/files/{file_id}/content", summary="A file's content (OpenAI)")
async def file_content(file_id: SafeText, tenant: Annotated[Tenant, Depends(current_tenant)]):
    if (job_id := result_job_id(file_id)) is not None:
        path, _ = await _result_path(tenant, job_id, file_id)
        return FileResponse(path, media_type="application/x-ndjson", filename=METRICS_FILE)
    return await files.get_file_content(file_id, tenant)


def result_file_id(job_id: str) -> str | None:
    """The id of a job's result file (its metrics.jsonl), for result_files."""
    digits = job_id.removeprefix("job-")
    return f"file-{digits}{RESULT_TAG}" if len(digits) == 12 and all(c in "0123456789abcdef" for c in digits) \
        else None


def result_job_id(file_id: str) -> str | None:
    """The job whose result file `file_id` is, or None (an upload's id)."""
    if not FILE_ID_RE.fullmatch(file_id) or not file_id.endswith(RESULT_TAG):
        return None
    return f"job-{file_id.removeprefix('file-')[:12]}"


async def _result_path(tenant: Tenant, job_id: str, file_id: str) -> tuple[Path, JobRecord]:
    """A job's metrics.jsonl inside the tenant's namespace (404 for another tenant's job, or before it exists)."""
    record = await tenant.get(job_id)
    root = PathPolicy(tenant.settings, tenant.name).owns_output(record.output_dir or record.spec.get("output_dir"))
    path = confine(root / METRICS_FILE, root) if root is not None else None
    if path is None or not path.is_file():
        raise ApiError(404, "not_found", f"no file {file_id!r}: job {job_id} has written no metrics yet",
                       field="file_id")
    return path, record


# ---- models -----------------------------------------------------------------------------------------------


# succeeded jobs read from the coordinator at a time while /models gathers a tenant's fine-tuned models
MODELS_PAGE = 1000


def fine_tuned_model(record: JobRecord, catalogue: dict) -> str:
    """The name a job's model is served and listed by: ``ft:<model>:<tenant>:<suffix>:<job id>``."""
    return f"ft:{model_name(record, catalogue)}:{record.tenant}:{record.name or ''}:{record.id}"


def final_dir(record: JobRecord, tenant: Tenant) -> Path | None:
    """The job's final/ model in the tenant's namespace of this service's storage, if it is there."""
    root = PathPolicy(tenant.settings, tenant.name).owns_output(record.output_dir or record.spec.get("output_dir"))
    final = confine(root / "final", root) if root is not None else None
    return final if final is not None and final.is_dir() else None


async def resolve_model(name: str, tenant: Tenant) -> tuple[Path, JobRecord | None]:
    """The directory a model name serves and its job: a finished job's final/ (the tenant's own only: another
    tenant's is a 404, as a model that does not exist) or a catalogue entry (no job)."""
    catalogue = tenant.settings.model_catalogue
    if not name.startswith("ft:"):
        if name in catalogue:
            return Path(catalogue[name]), None
        known = ", ".join(sorted(catalogue)) or "none in the catalogue"
        raise ApiError(404, "model_not_found", f"the model {name!r} does not exist; use a finished job's "
                       f"fine_tuned_model or a base model ({known})", field="model")
    missing = ApiError(404, "model_not_found", f"the model {name!r} does not exist: name a fine_tuned_model of one "
                       "of your finished jobs", field="model")
    job_id = name.rsplit(":", 1)[-1]
    try:
        record = await tenant.get(job_id)
    except JobNotFound:
        raise missing from None
    if record.status is not JobStatus.SUCCEEDED:
        raise ApiError(404, "model_not_found", f"job {job_id} is {record.status.value}: its model is served once "
                       "the job has succeeded", field="model")
    if name != fine_tuned_model(record, catalogue):
        raise missing
    if (final := final_dir(record, tenant)) is None:
        raise ApiError(404, "model_not_found", f"job {job_id} has no final model on this service's storage",
                       field="model")
    return final, record


def model_object(name: str, record: JobRecord | None) -> dict[str, Any]:
    """OpenAI's `model` object: a catalogue model is the operator's, a fine-tuned one its tenant's."""
    if record is None:
        return {"id": name, "object": "model", "created": 0, "owned_by": "horizon-ray"}
    return {"id": name, "object": "model", "created": int(record.finished_at or record.created_at),
            "owned_by": record.tenant}


@router.get("/models", summary="The catalogue's base models and your fine-tuned models (OpenAI)")
async def list_models(tenant: Annotated[Tenant, Depends(current_tenant)]) -> dict[str, Any]:
    catalogue = tenant.settings.model_catalogue
    data = [model_object(n, None) for n in sorted(catalogue)]
    after = None
    while True:  # the tenant's succeeded jobs, newest first: those whose final/ is here serve under their ft: name
        records, more = await tenant.list(limit=MODELS_PAGE, after=after, status=JobStatus.SUCCEEDED)
        data += [model_object(fine_tuned_model(r, catalogue), r) for r in records if final_dir(r, tenant)]
        if not more:
            return {"object": "list", "data": data}
        after = records[-1].id


@router.get("/models/{model:path}", summary="One model: a catalogue model or one of your fine-tuned models (OpenAI)")
async def retrieve_model(model: SafeText, tenant: Annotated[Tenant, Depends(current_tenant)]) -> dict[str, Any]:
    _, record = await resolve_model(model, tenant)
    return model_object(model, record)


# ---- fine-tuning jobs -------------------------------------------------------------------------------------


def job_spec(body: CreateJob, catalogue: dict) -> dict[str, Any]:
    """The job spec an OpenAI create request asks for (the module doc's mapping); ApiError naming the
    parameter when it cannot be served."""
    if body.model not in catalogue:
        close = difflib.get_close_matches(body.model, list(catalogue), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        known = ", ".join(sorted(catalogue)) or f"none: the operator sets {ENV_MODEL_CATALOGUE}"
        raise ApiError(404, "model_not_found", f"the model {body.model!r} does not exist{hint}; models here: {known}",
                       field="model")
    for param in ("training_file", "validation_file"):
        value = getattr(body, param)
        if value is not None and not FILE_ID_RE.fullmatch(value):
            raise ApiError(400, "invalid_file", f"{param} {value!r} is not a file id; upload the data with "
                           "files.create(file=..., purpose='fine-tune') and pass its id", field=param)
    if body.metadata:
        raise ApiError(400, "unsupported_parameter", "metadata is not stored by this service; leave it out",
                       field="metadata")
    hyper = body.hyperparameters
    dpo = body.method is not None and body.method.type == "dpo"
    if body.method is not None:
        if body.method.type not in ("supervised", "dpo"):
            raise ApiError(400, "unsupported_method", f"method {body.method.type!r} is not served here; this "
                           "service trains supervised and dpo fine-tunes", field="method.type")
        section = body.method.dpo if dpo else body.method.supervised
        inner = section.hyperparameters if section else None
        if inner is not None and hyper is not None and inner.model_dump(include=set(Hyperparameters.model_fields)) \
                != hyper.model_dump():
            raise ApiError(400, "conflicting_parameters", f"hyperparameters and method.{body.method.type}."
                           "hyperparameters differ; give them once", field="hyperparameters")
        hyper = inner or hyper
    hyper = hyper or Hyperparameters()

    spec: dict[str, Any] = json.loads(json.dumps(body.spec or {}))
    if not isinstance(spec.get("training", {}), dict) or not isinstance(spec.get("data", {}), dict):
        raise ApiError(400, "invalid_spec", "spec.training and spec.data must be objects", field="spec")
    training = spec.setdefault("training", {})
    data = spec.setdefault("data", {})
    if not isinstance(spec.setdefault("checkpoint", {}), dict):
        raise ApiError(400, "invalid_spec", "spec.checkpoint must be an object", field="spec.checkpoint")
    spec["checkpoint"].setdefault("every_steps", CHECKPOINT_EVERY)
    spec["checkpoint"].setdefault("keep", CHECKPOINT_KEEP)
    spec["model"] = {**(spec.get("model") or {}), "path": body.model}
    data["path"] = body.training_file
    if body.validation_file:
        data["eval_path"] = body.validation_file
        data.pop("eval_fraction", None)
    else:
        data.setdefault("eval_fraction", 0.0)
    epochs = AUTO_EPOCHS if hyper.n_epochs in (None, "auto") else hyper.n_epochs
    training.setdefault("epochs", epochs)
    if hyper.n_epochs not in (None, "auto"):
        training["epochs"] = hyper.n_epochs
    if dpo:  # OpenAI's preference format; a batch of pairs is twice as many rows (chosen and rejected)
        spec["objective"] = "dpo"
        beta = getattr(hyper, "beta", None)
        if beta not in (None, "auto"):
            spec["dpo"] = {**(spec.get("dpo") or {}), "beta": beta}
    if hyper.batch_size not in (None, "auto"):
        training.update(micro_batch_size=hyper.batch_size * (2 if dpo else 1), grad_accum=1, packing=False)
    if hyper.learning_rate_multiplier is not None and hyper.learning_rate_multiplier != "auto":
        base = training.get("lr", TrainingSpec().lr)
        training["lr"] = float(base) * hyper.learning_rate_multiplier
    if hyper.quantize is not None:
        if spec.setdefault("method", "lora") != "lora":
            raise ApiError(400, "conflicting_parameters", f"hyperparameters.quantize {hyper.quantize!r} quantizes "
                           f"LoRA's frozen base, but spec.method is {spec['method']!r}; use method lora or leave "
                           "quantize out", field="hyperparameters.quantize")
        if not isinstance(spec.setdefault("lora", {}), dict):
            raise ApiError(400, "invalid_spec", "spec.lora must be an object", field="spec.lora")
        spec["lora"]["quantize"] = hyper.quantize
    if body.seed is not None:
        training["seed"] = body.seed
    if body.suffix is not None:
        spec["name"] = body.suffix
    for integration in body.integrations or []:
        spec.setdefault("integrations", {})["wandb"] = integration.wandb.model_dump(exclude_none=True)
    return spec


@router.post("/fine_tuning/jobs", summary="Create a fine-tuning job (OpenAI)")
async def create_job(raw: Annotated[dict[str, Any], Body(description=(
                         "OpenAI's create parameters: model, training_file, validation_file, hyperparameters "
                         "{n_epochs, batch_size, learning_rate_multiplier}, suffix, seed, method {type: supervised}, "
                         "integrations [wandb]; and spec, any other job spec fields"),
                         openapi_examples={"sdk": {"summary": "what the SDK sends", "value": {
                             "model": "qwen2.5-0.5b-instruct", "training_file": "file-0123456789abcdef01234567",
                             "hyperparameters": {"n_epochs": 2}, "suffix": "support-bot"}}})],
                     tenant: Annotated[Tenant, Depends(current_tenant)],
                     idempotency_key: Annotated[SafeText | None, Header(alias="Idempotency-Key",
                                                                        max_length=255)] = None,
                     ) -> dict[str, Any]:
    try:
        body = CreateJob.model_validate(raw)
    except ValidationError as exc:  # named by OpenAI's parameter, as the job spec's errors are by its keys
        bad = spec_error(exc.errors()[0], CreateJob)
        raise ApiError(400, "invalid_request", bad.message, field=bad.field) from None
    spec = job_spec(body, tenant.settings.model_catalogue)
    try:
        parsed = JobSpec.parse(spec)
    except BadInput as exc:
        raise ApiError(400, "invalid_spec", exc.message, field=exc.field) from None
    except ValidationError as exc:  # pragma: no cover - parse raises BadInput for every pydantic error
        bad = spec_error(exc.errors()[0])
        raise ApiError(400, "invalid_spec", bad.message, field=bad.field) from None
    record = await tenant.submit(checked_spec(tenant, parsed), idempotency_key=idempotency_key, priority=0,
                                 name=body.suffix)
    return job_object(record, tenant)


@router.get("/fine_tuning/jobs", summary="List your fine-tuning jobs, newest first (OpenAI)")
async def list_jobs(tenant: Annotated[Tenant, Depends(current_tenant)],
                    after: Annotated[SafeText | None, Query(min_length=1, max_length=64)] = None,
                    limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    records, has_more = await tenant.list(limit=limit, after=after)
    return _page([job_object(r, tenant) for r in records], has_more=has_more)


@router.get("/fine_tuning/jobs/{job_id}", summary="One fine-tuning job (OpenAI)")
async def retrieve_job(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)]) -> dict[str, Any]:
    return job_object(await tenant.get(job_id), tenant)


@router.post("/fine_tuning/jobs/{job_id}/cancel", summary="Cancel a fine-tuning job (OpenAI)")
async def cancel_job(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)]) -> dict[str, Any]:
    return job_object(await tenant.cancel(job_id), tenant)


@router.get("/fine_tuning/jobs/{job_id}/events", summary="A job's events, newest first (OpenAI)")
async def list_events(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)],
                      after: Annotated[SafeText | None, Query(min_length=1, max_length=128)] = None,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict[str, Any]:
    # A job's events are numbered 1..last_seq: a page reads only its window (plus what is newer than a
    # cursor), not the job's whole history.
    top = (await tenant.get(job_id)).last_seq
    if after is not None:
        top = min(top, _seq_of(after, job_id, "ftevent") - 1)
    start = max(0, top - limit - 1)
    events = sorted((e for e in await tenant.events(job_id, start) if e.seq <= top), key=lambda e: -e.seq)
    page = [event_object(e) for e in events[:limit]]
    return _page(page, has_more=len(events) > limit)


@router.get("/fine_tuning/jobs/{job_id}/checkpoints", summary="A job's checkpoints, newest first (OpenAI)")
async def list_checkpoints(job_id: JOB_ID, tenant: Annotated[Tenant, Depends(current_tenant)],
                           after: Annotated[SafeText | None, Query(min_length=1, max_length=128)] = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 10) -> dict[str, Any]:
    record = await tenant.get(job_id)
    ckpts = sorted(await tenant.checkpoints(job_id), key=lambda c: -c.step)
    if record.status is JobStatus.SUCCEEDED and record.progress.step and record.output_dir and (
            not ckpts or ckpts[0].step < record.progress.step):
        # the model after the last step is final/ (the runner writes no checkpoint there: it would be a copy)
        ckpts.insert(0, Checkpoint(step=record.progress.step, path=f"{record.output_dir}/final",
                                   time=record.finished_at or record.updated_at or record.created_at))
    if after is not None:
        cut = _seq_of(after, job_id, "ftckpt")
        ckpts = [c for c in ckpts if c.step < cut]
    metrics = _step_metrics(await tenant.events(job_id, 0)) if ckpts else {}
    page = [checkpoint_object(record, c, metrics.get(c.step, {}), tenant) for c in ckpts[:limit]]
    return _page(page, has_more=len(ckpts) > limit)


# ---- records -> OpenAI objects ----------------------------------------------------------------------------


def _page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def _seq_of(cursor: str, job_id: str, kind: str) -> int:
    """The number at the end of an event or checkpoint id of this job (`<kind>-<job id>-<n>`); 404 otherwise."""
    head, _, n = cursor.rpartition("-")
    if head != f"{kind}-{job_id}" or not n.isdecimal():
        raise ApiError(404, "not_found", f"no {kind} {cursor!r} of job {job_id}", field="after")
    return int(n)


def _ts(t: float | None) -> int | None:
    return None if t is None else int(t)


def model_name(record: JobRecord, catalogue: dict) -> str:
    """The catalogue name of the job's base model, else its directory's name."""
    path = str((record.spec.get("model") or {}).get("path") or "")
    for name, target in catalogue.items():
        if str(target) == path:
            return name
    return path.rstrip("/").rsplit("/", 1)[-1] or path


def _file_id(path: Any) -> str | None:
    """The upload id of a dataset path (`.../file-<hex>.jsonl`), else the path."""
    if not isinstance(path, str) or not path:
        return None
    stem = path.rsplit("/", 1)[-1].removesuffix(".jsonl")
    return stem if FILE_ID_RE.fullmatch(stem) else path


def _method(spec: dict[str, Any], hyper: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's method object of a job: supervised, or dpo with beta (a batch counts pairs)."""
    if spec.get("objective") != "dpo":
        return {"type": "supervised", "supervised": {"hyperparameters": hyper}}
    dpo = {**hyper, "beta": (spec.get("dpo") or {}).get("beta", DpoSpec().beta)}
    return {"type": "dpo", "dpo": {"hyperparameters": dpo}}


def job_object(record: JobRecord, tenant: Tenant) -> dict[str, Any]:
    """A job record as OpenAI's `fine_tuning.job` (with horizon-ray's progress and download links)."""
    spec = record.spec or {}
    training, data = spec.get("training") or {}, spec.get("data") or {}
    model = model_name(record, tenant.settings.model_catalogue)
    hyper = {"n_epochs": training.get("epochs") if training.get("epochs") is not None else "auto",
             "batch_size": (training.get("micro_batch_size", 1) * training.get("grad_accum", 1)
                            if training.get("packing") is False else "auto"),
             "learning_rate_multiplier": round(float(training.get("lr", TrainingSpec().lr)) / TrainingSpec().lr, 6)}
    if spec.get("objective") == "dpo" and isinstance(hyper["batch_size"], int):
        hyper["batch_size"] //= 2  # pairs, as the create request's counts them: a pair is two rows
    quantize = (spec.get("lora") or {}).get("quantize", "none") if spec.get("method") == "lora" else "none"
    if quantize != "none":
        hyper["quantize"] = quantize
    succeeded = record.status is JobStatus.SUCCEEDED
    p = record.progress
    eta = p.eta_s if p.eta_s is not None and math.isfinite(p.eta_s) and not record.status.is_terminal() else None
    base = f"/finetune/{record.id}/outputs"
    out = {
        "id": record.id, "object": "fine_tuning.job", "created_at": int(record.created_at),
        "error": ({"code": record.error.code, "message": record.error.message, "param": None}
                  if record.error else None),
        "fine_tuned_model": fine_tuned_model(record, tenant.settings.model_catalogue) if succeeded else None,
        "finished_at": _ts(record.finished_at), "hyperparameters": hyper, "model": model,
        "organization_id": record.tenant, "seed": int(training.get("seed", 0)),
        "result_files": [rid] if (rid := result_file_id(record.id)) and record.progress.step else [],
        "status": STATUS[record.status], "training_file": _file_id(data.get("path")),
        "trained_tokens": record.metrics.get("tokens_seen") if isinstance(record.metrics, dict) else None,
        "validation_file": _file_id(data.get("eval_path")),
        "estimated_finish": int(time.time() + eta) if eta is not None else None,
        "integrations": ([{"type": "wandb", "wandb": spec["integrations"]["wandb"]}]
                         if (spec.get("integrations") or {}).get("wandb") else []),
        "metadata": None, "user_provided_suffix": record.name,
        "method": _method(spec, hyper),
        # horizon-ray's own: where it stands and where its files are
        "progress": {"step": p.step, "total_steps": p.total_steps, "tokens_per_s": p.tokens_per_s, "eta_s": eta},
        "outputs_url": base, "final_model_url": f"{base}/final.tar" if succeeded else None,
    }
    return out


def event_message(event: JobEvent) -> tuple[str, str, str]:
    """(level, type, message) of an event, in the words OpenAI's events use."""
    d = event.data
    if event.type is EventType.METRICS:
        if "eval_loss" in d:
            rewards = format_rewards(d.get("eval_preference"))  # a DPO job's: what it is judged by
            return "info", "metrics", (f"Step {d.get('step')}: validation loss={_num(d['eval_loss'])}"
                                       + (f", {rewards}" if rewards else ""))
        total = f"/{d['total_steps']}" if d.get("total_steps") else ""
        rewards = format_rewards(d.get("preference"))
        return "info", "metrics", (f"Step {d.get('step')}{total}: training loss={_num(d.get('loss'))}"
                                   + (f", {rewards}" if rewards else ""))
    if event.type is EventType.CHECKPOINT:
        return "info", "message", f"Checkpoint created at step {d.get('step')}"
    if event.type is EventType.ERROR:
        return "error", "message", str(d.get("message") or "error")
    if event.type is EventType.MEMORY:
        used, planned = (d.get("rss_bytes") or 0) / 2**30, (d.get("planned_bytes") or 0) / 2**30
        return "info", "message", f"Host memory {used:.1f} GiB of {planned:.1f} GiB planned"
    to = d.get("to")
    words = {"validating": "Validating training file", "queued": "Job enqueued", "running": "Job started",
             "checkpointing": "Writing a checkpoint", "recovering": "Job is recovering",
             "cancelling": "Cancelling the job", "succeeded": "The job has successfully completed",
             "failed": "The job failed", "cancelled": "The job was cancelled"}.get(str(to), f"Status {to}")
    reason = f": {d['reason']}" if d.get("reason") else ""
    return ("error" if to == "failed" else "info"), "message", f"{words}{reason}"


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, int | float) else str(x)


def event_object(event: JobEvent) -> dict[str, Any]:
    level, kind, message = event_message(event)
    data = dict(event.data)
    if kind == "metrics" and "loss" in data:
        data["train_loss"] = data["loss"]
    return {"id": f"ftevent-{event.job_id}-{event.seq}", "object": "fine_tuning.job.event",
            "created_at": int(event.time), "level": level, "message": message, "type": kind,
            "data": _json_safe(data)}


def _step_metrics(events: list[JobEvent]) -> dict[int, dict[str, float]]:
    """step -> {train_loss, valid_loss} from a job's metrics events."""
    out: dict[int, dict[str, float]] = {}
    for e in events:
        if e.type is not EventType.METRICS or not isinstance(e.data.get("step"), int):
            continue
        m = out.setdefault(e.data["step"], {"step": float(e.data["step"])})
        if isinstance(e.data.get("loss"), int | float):
            m["train_loss"] = float(e.data["loss"])
        if isinstance(e.data.get("eval_loss"), int | float):
            m["valid_loss"] = m["full_valid_loss"] = float(e.data["eval_loss"])
    return out


def checkpoint_object(record: JobRecord, ckpt: Checkpoint, metrics: dict[str, float],
                      tenant: Tenant) -> dict[str, Any]:
    return {"id": f"ftckpt-{record.id}-{ckpt.step}", "object": "fine_tuning.job.checkpoint",
            "created_at": int(ckpt.time), "fine_tuning_job_id": record.id, "step_number": ckpt.step,
            "fine_tuned_model_checkpoint": f"{fine_tuned_model(record, tenant.settings.model_catalogue)}:ckpt-step-"
                                           f"{ckpt.step}",
            "metrics": _json_safe(metrics or {"step": float(ckpt.step)})}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# ---- errors in OpenAI's shape -----------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error"}


def openai_errors(app: FastAPI) -> None:
    """Give every error of a /v1 route OpenAI's body, {"error": {"message", "type", "param", "code"}}, and a
    refusal of invalid input OpenAI's status, 400. The status and code are decided where every error is
    (api.errors); only the envelope changes. Call after install_error_handlers."""
    for exc_type, handler in list(app.exception_handlers.items()):
        app.add_exception_handler(exc_type, _reshaping(handler))


# The job spec keys a fine-tuning request sets from OpenAI's parameters (job_spec), named back by those parameters
# in its errors: the checks that refuse them (the upload's format, the objective) are the job spec's, shared with
# POST /finetune, and speak its keys.
SPEC_PARAMS = {"data.path": "training_file", "data.eval_path": "validation_file", "data.format": "training_file",
               "objective": "method.type"}
_SPEC_WORDS = re.compile(r"\bdata\.(eval_)?path\b")


def _openai_param(request: Request, field: Any, message: str) -> tuple[Any, str]:
    if not request.url.path.startswith(PREFIX + "/fine_tuning/"):
        return field, message
    message = _SPEC_WORDS.sub(lambda m: "validation_file" if m.group(1) else "training_file", message)
    return SPEC_PARAMS.get(field, field), message


def _reshaping(handler: Callable) -> Callable:
    async def reshaped(request: Request, exc: Exception):
        response = await handler(request, exc)
        if not request.url.path.startswith(PREFIX + "/") or not isinstance(response, JSONResponse):
            return response
        body = json.loads(bytes(response.body))
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return response
        status = 400 if response.status_code == 422 else response.status_code
        param, message = _openai_param(request, err.get("field"), err.get("message", ""))
        shaped = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                            "param": param, "code": err.get("code"),
                            # a placement refusal's verdict of every node, as /finetune gives them
                            **({"details": err["details"]} if "nodes" in (err.get("details") or {}) else {})}}
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return SafeJSONResponse(shaped, status_code=status, headers=headers)

    return reshaped
