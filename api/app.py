"""The app factory: ``create_app(client, settings) -> FastAPI``.

    from api.app import create_app
    from api.settings import ApiSettings
    app = create_app(client, ApiSettings.from_env())        # client: any CoordinatorClient
    uvicorn.run(app, host="127.0.0.1", port=8000)

or, against the coordinator of a running Ray cluster, ``uvicorn --factory api.app:app_from_env``.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

import horizon_ray
from api import cluster_routes, files
from api.errors import install_error_handlers
from api.jobs import job_routes
from api.limits import BodyLimitMiddleware
from api.metrics import ApiMetrics, MetricsMiddleware
from api.settings import ApiSettings
from horizon_ray import jobspec
from horizon_ray.cluster.client import CoordinatorClient

STATIC_DIR = Path(__file__).resolve().parent / "static"
JOB_BASES = ("/finetune", "/v1/fine_tuning/jobs")


def create_app(client: CoordinatorClient, settings: ApiSettings) -> FastAPI:
    """The HTTP front end over `client`; `settings` holds keys, roots and limits."""
    app = FastAPI(
        title="horizon-ray",
        version=horizon_ray.__version__,
        description="Fine-tune large language models where host RAM, not GPU memory, is the limit. "
                    "Every route except /healthz, /readyz and /metrics needs `Authorization: Bearer <key>`.",
    )
    app.state.client = client
    app.state.settings = settings
    app.state.metrics = ApiMetrics(client)
    install_error_handlers(app)

    app.include_router(job_routes(JOB_BASES[0]))
    if settings.openai_mirror:
        app.include_router(job_routes(JOB_BASES[1]))
    app.include_router(files.router)
    app.include_router(cluster_routes.router)
    app.include_router(cluster_routes.health)
    _mount_dashboard(app)

    def limit_for(scope: Scope) -> int:
        if scope.get("method") == "POST" and scope.get("path", "").rstrip("/") == "/files":
            return settings.max_upload_bytes
        return settings.max_body_bytes

    # The middleware added last runs outermost: metrics see every answer, the body limit's 413s too.
    app.add_middleware(BodyLimitMiddleware, limit_for=limit_for)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.openapi = lambda: _openapi(app)
    return app


def app_from_env() -> FastAPI:
    """`uvicorn --factory api.app:app_from_env`: settings from HORIZON_* variables, the Ray coordinator
    at HORIZON_RAY_ADDRESS (default "auto")."""
    import os

    from horizon_ray.cluster.client import RayClient

    return create_app(RayClient(os.environ.get("HORIZON_RAY_ADDRESS") or None), ApiSettings.from_env())


# The dashboard loads nothing from elsewhere and runs no inline script.
_DASHBOARD_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                  "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def _mount_dashboard(app: FastAPI) -> None:
    index = STATIC_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    async def dashboard() -> Response:
        return FileResponse(index, media_type="text/html", headers={
            "Cache-Control": "no-cache", "Content-Security-Policy": _DASHBOARD_CSP,
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


# ---- OpenAPI: document the job spec body with the schema of horizon_ray.jobspec ------------------------


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(jobspec_schemas())
    components.setdefault("securitySchemes", {})
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    open_paths = {"/healthz", "/readyz", "/metrics"}
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            if path not in open_paths:
                op["security"] = [{"bearer": []}]
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None and path in ("/plan", *JOB_BASES):
                body["schema"] = {"$ref": "#/components/schemas/JobSpec"}
    app.openapi_schema = schema
    return schema


# Fields whose value must be one of a fixed set (validated by JobSpec too; here for documentation).
_ENUMS = {
    ("DataSpec", "format"): jobspec.DATA_FORMATS,
    ("JobSpec", "method"): jobspec.METHODS,
    ("ScheduleSpec", "type"): jobspec.SCHEDULES,
    ("EngineSpec", "compute_dtype"): jobspec.COMPUTE_DTYPES,
    ("EngineSpec", "precision"): jobspec.PRECISIONS,
}
_DESCRIPTIONS = {
    ("ModelSpec", "path"): "catalogue name, or a model directory relative to (or inside) a model root",
    ("ModelSpec", "tokenizer_path"): "like path; default: the model directory",
    ("DataSpec", "path"): "an uploaded file id (file-...), or a JSONL file relative to (or inside) a data root",
    ("DataSpec", "eval_path"): "like path",
    ("JobSpec", "output_dir"): "optional; relative to your output namespace. Default: one directory per job",
}


def jobspec_schemas() -> dict[str, Any]:
    """JSON schemas of JobSpec and its sections (strict: no additional properties), by dataclass name."""
    out: dict[str, Any] = {}

    def visit(cls: type) -> None:
        hints = typing.get_type_hints(cls)
        props: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            prop = _type_schema(tp, visit)
            if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(tp):
                prop["default"] = copy.deepcopy(f.default)
            if (cls.__name__, f.name) in _ENUMS:
                prop["enum"] = list(_ENUMS[(cls.__name__, f.name)])
            if (cls.__name__, f.name) in _DESCRIPTIONS:
                prop["description"] = _DESCRIPTIONS[(cls.__name__, f.name)]
            props[f.name] = prop
        out[cls.__name__] = {"type": "object", "title": cls.__name__, "properties": props,
                             "additionalProperties": False}

    visit(jobspec.JobSpec)
    return out


def _type_schema(tp: Any, visit) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return {"anyOf": [_type_schema(args[0], visit), {"type": "null"}]}
    if dataclasses.is_dataclass(tp):
        visit(tp)
        return {"$ref": f"#/components/schemas/{tp.__name__}"}
    if origin is list:
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0], visit)}
    return {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"},
            str: {"type": "string"}}[tp]
