"""The app factory: ``create_app(client, settings) -> FastAPI``.

    from api.app import create_app
    from api.settings import ApiSettings
    app = create_app(client, ApiSettings.from_env())        # client: any CoordinatorClient
    uvicorn.run(app, host="127.0.0.1", port=8000)

or, against the coordinator of a running Ray cluster, ``uvicorn --factory api.app:app_from_env``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

import horizon_ray
from api import chat, cluster_routes, files, openai
from api.errors import SafeJSONResponse, install_error_handlers
from api.jobs import job_routes
from api.limits import BodyLimitMiddleware
from api.metrics import ApiMetrics, MetricsMiddleware
from api.quotas import TenantLimits
from api.settings import ApiSettings
from api.streams import EventHub
from horizon_ray.cluster.client import CoordinatorClient
from horizon_ray.errors import BadInput
from horizon_ray.generation import ModelPool

STATIC_DIR = Path(__file__).resolve().parent / "static"
UPLOAD_ROUTES = ("/files", openai.PREFIX + "/files")  # POST bodies that are datasets: the upload limit


def create_app(client: CoordinatorClient, settings: ApiSettings, generation: Any = None) -> FastAPI:
    """The HTTP front end over `client`; `settings` holds keys, roots and limits; `generation`: what runs
    /v1/chat/completions (an in-process horizon_ray.generation.ModelPool when None)."""
    app = FastAPI(
        title="horizon-ray",
        version=horizon_ray.__version__,
        description="Fine-tune large language models where host RAM, not GPU memory, is the limit. "
                    "Every route except /healthz, /readyz and /metrics needs `Authorization: Bearer <key>`.",
        default_response_class=SafeJSONResponse,
        docs_url=None,  # the CDN pages FastAPI would serve; see _mount_docs
        redoc_url=None,
    )
    app.state.client = client
    app.state.settings = settings
    app.state.metrics = ApiMetrics(client)
    app.state.limits = TenantLimits(settings)
    app.state.hub = EventHub(client, poll_s=settings.sse_poll_s, threads=settings.stream_poll_threads)
    app.state.generation = generation if generation is not None else ModelPool()
    files.sweep_stale_uploads(settings)  # parts a server killed mid-upload left: no process finishes them
    install_error_handlers(app)

    app.include_router(job_routes("/finetune"))
    if settings.openai_api:
        app.include_router(openai.router)
        app.include_router(chat.router)
        openai.openai_errors(app)
    app.include_router(files.router)
    app.include_router(cluster_routes.router)
    app.include_router(cluster_routes.health)
    _mount_dashboard(app)
    if settings.docs:
        _mount_docs(app)

    def limit_for(scope: Scope) -> int:
        if scope.get("method") == "POST" and scope.get("path", "").rstrip("/") in UPLOAD_ROUTES:
            return settings.max_upload_bytes
        return settings.max_body_bytes

    # The middleware added last runs outermost: metrics see every answer, the body limit's 413s too.
    app.add_middleware(BodyLimitMiddleware, limit_for=limit_for)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app


def app_from_env() -> FastAPI:
    """`uvicorn --factory api.app:app_from_env`: settings from HORIZON_* variables, the Ray coordinator
    at HORIZON_RAY_ADDRESS (default "auto"). The connection to Ray is made in the background and made again
    after a loss (a head restart): /readyz answers 503 until the coordinator answers."""
    import os

    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.gate import service_credential
    from horizon_ray.cluster.generation import RayGeneration

    settings = ApiSettings.from_env()  # bad settings fail here, before anything connects
    settings.check_served_keys()
    # the API's credential at the coordinator's gate, derived from the keys it verifies itself
    client = RayClient(os.environ.get("HORIZON_RAY_ADDRESS") or None, lazy=True,
                       credential=service_credential(settings.api_keys))
    # /v1/chat/completions: each model in a Ray actor on a node whose RAM holds it, reserved in its ledger
    return create_app(client, settings, generation=RayGeneration(client))


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


# Swagger UI from files on this machine: no script or style from elsewhere, no inline script.
_DOCS_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
             "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
_DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>horizon-ray API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script><script src="/docs/init.js"></script></body></html>
"""
_DOCS_INIT = """window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis], layout: "BaseLayout"});
"""


def _mount_docs(app: FastAPI) -> None:
    """/docs: Swagger UI from the swagger-ui-bundle package's own files, under a CSP. Clusters are often
    offline, and the dashboard keeps the API key on this origin: nothing is loaded from a CDN."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        raise BadInput("the docs setting (HORIZON_API_DOCS) serves /docs from the swagger-ui-bundle package, "
                       "which is not installed: pip install 'horizon-ray[docs]', or turn the setting off") from None
    headers = {"Content-Security-Policy": _DOCS_CSP, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return Response(_DOCS_PAGE, media_type="text/html", headers=headers)

    @app.get("/docs/init.js", include_in_schema=False)
    async def docs_init() -> Response:
        return Response(_DOCS_INIT, media_type="text/javascript", headers=headers)

    app.mount("/docs/assets", StaticFiles(directory=swagger_ui_path), name="docs-assets")
