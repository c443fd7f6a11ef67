"""Bearer API keys -> tenants, and the one dependency that scopes a request to its tenant.

Every tenant-scoped route takes a ``Tenant`` from ``current_tenant`` and reaches the coordinator, the
tenant's files and its outputs only through it: the tenant name is bound once, here, so no route can
ask about another tenant's job or open another tenant's directory.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from api.settings import ApiSettings
from horizon_ray.cluster.client import CoordinatorClient

_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Bearer realm="horizon-ray"'}


async def call_client(client: CoordinatorClient, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call a (blocking) client method off the event loop."""
    return await run_in_threadpool(getattr(client, method), *args, **kwargs)


@dataclass(frozen=True)
class Tenant:
    """A request's tenant: its name, and the coordinator and directories seen through it."""

    name: str  # the tenant the API key maps to
    client: CoordinatorClient  # the coordinator client; only called with `name`
    settings: ApiSettings  # roots and limits

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<method>(tenant, *args, **kwargs)``: every coordinator call of a route goes here."""
        return await call_client(self.client, method, self.name, *args, **kwargs)

    @property
    def files_dir(self) -> Path:
        return self.settings.files_dir(self.name)

    @property
    def outputs_dir(self) -> Path:
        return self.settings.outputs_dir(self.name)


def tenant_for_key(settings: ApiSettings, presented: str) -> str | None:
    """The tenant of an API key, comparing against every key in constant time."""
    found = None
    for key, tenant in settings.api_keys.items():
        if hmac.compare_digest(key.encode(), presented.encode()):
            found = tenant
    return found


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise ApiError(401, "unauthorized", "missing API key; send 'Authorization: Bearer <key>'",
                       headers=_UNAUTHORIZED_HEADERS)
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "malformed Authorization header; send 'Authorization: Bearer <key>'",
                       headers=_UNAUTHORIZED_HEADERS)
    return token.strip()


# Documents the scheme in the OpenAPI schema of every route that depends on current_tenant; the header is
# checked below, for errors of our own form.
_BEARER = HTTPBearer(scheme_name="bearer", auto_error=False, description="an API key: `Authorization: Bearer <key>`")


async def current_tenant(request: Request,
                         _: HTTPAuthorizationCredentials | None = Depends(_BEARER)) -> Tenant:
    """The dependency of every tenant-scoped route: 401 without a valid key, else the key's tenant."""
    settings: ApiSettings = request.app.state.settings
    tenant = tenant_for_key(settings, bearer_token(request))
    if tenant is None:
        raise ApiError(401, "unauthorized", "invalid API key", headers=_UNAUTHORIZED_HEADERS)
    request.state.tenant = tenant
    return Tenant(name=tenant, client=request.app.state.client, settings=settings)
