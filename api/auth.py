"""Bearer API keys -> tenants, and the one dependency that scopes a request to its tenant.

Every tenant-scoped route takes a ``Tenant`` from ``current_tenant`` and reaches the coordinator, the
tenant's files and its outputs only through it: the tenant name is bound once, here, so no route can
ask about another tenant's job or open another tenant's directory. Its methods are the coordinator
client's (``CoordinatorClient``), run off the event loop.
"""

from __future__ import annotations

import builtins
import collections
import hmac
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from api.settings import ApiSettings
from horizon_ray.cluster.client import CoordinatorClient
from horizon_ray.cluster.messages import Checkpoint, JobEvent, JobRecord, JobStatus, NodeInfo

NO_AUTH_TENANT = "default"  # the tenant of every request without authentication (ApiSettings.insecure_no_auth)
_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Bearer realm="horizon-ray"'}


@dataclass(frozen=True)
class Tenant:
    """A request's tenant: its name, and the coordinator and directories seen through it."""

    name: str  # the tenant the API key maps to
    client: CoordinatorClient  # the coordinator client; only called with `name`
    settings: ApiSettings  # roots and limits

    async def submit(self, spec: dict[str, Any], *, idempotency_key: str | None, priority: int,
                     name: str | None = None) -> JobRecord:
        return await run_in_threadpool(self.client.submit, self.name, spec, idempotency_key=idempotency_key,
                                       priority=priority, name=name)

    async def get(self, job_id: str) -> JobRecord:
        return await run_in_threadpool(self.client.get, self.name, job_id)

    async def list(self, *, limit: int, after: str | None = None,
                   status: JobStatus | None = None) -> tuple[builtins.list[JobRecord], bool]:
        return await run_in_threadpool(self.client.list, self.name, limit=limit, after=after, status=status)

    async def cancel(self, job_id: str) -> JobRecord:
        return await run_in_threadpool(self.client.cancel, self.name, job_id)

    async def events(self, job_id: str, after_seq: int = 0, limit: int | None = None) -> builtins.list[JobEvent]:
        return await run_in_threadpool(self.client.events, self.name, job_id, after_seq, limit)

    async def checkpoints(self, job_id: str) -> builtins.list[Checkpoint]:
        return await run_in_threadpool(self.client.checkpoints, self.name, job_id)

    async def plan(self, spec: dict[str, Any]) -> dict[str, Any]:
        return await run_in_threadpool(self.client.plan, self.name, spec)

    async def queue(self) -> builtins.list[JobRecord]:
        """This tenant's waiting jobs."""
        return await run_in_threadpool(self.client.queue, self.name)

    async def nodes(self) -> builtins.list[NodeInfo]:
        """Every node (the cluster's, not the tenant's: callers anonymise other tenants' reservations)."""
        return await run_in_threadpool(self.client.nodes)

    async def waiting(self) -> int:
        """How many jobs of every tenant wait for a node."""
        return len(await run_in_threadpool(self.client.queue, None))

    @property
    def files_dir(self) -> Path:
        return self.settings.files_dir(self.name)

    @property
    def outputs_dir(self) -> Path:
        return self.settings.outputs_dir(self.name)


class AuthFailures:
    """Wrong-key requests per client address: past WRONG_KEY_BURST of them within WRONG_KEY_WINDOW_S, the
    address gets 429 with Retry-After instead of another guess."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, collections.deque[float]] = {}

    def fail(self, address: str) -> int:
        """Record a wrong key from `address`; the seconds it must wait (0: it may try again now)."""
        now = self._clock()
        with self._lock:
            if len(self._seen) > 10_000:  # many addresses: drop those with no failure in the window
                self._seen = {a: q for a, q in self._seen.items() if q and now - q[-1] < WRONG_KEY_WINDOW_S}
            seen = self._seen.setdefault(address, collections.deque())
            while seen and now - seen[0] >= WRONG_KEY_WINDOW_S:
                seen.popleft()
            seen.append(now)
            if len(seen) <= WRONG_KEY_BURST:
                return 0
            return max(1, math.ceil(WRONG_KEY_WINDOW_S - (now - seen[0])))


WRONG_KEY_BURST = 50  # wrong keys an address may send within the window before it waits
WRONG_KEY_WINDOW_S = 60.0


def _failures(request: Request) -> AuthFailures:
    state = request.app.state
    found = getattr(state, "auth_failures", None)
    if found is None:
        found = state.auth_failures = AuthFailures()
    return found


def tenant_for_key(settings: ApiSettings, presented: str) -> str | None:
    """The tenant of an API key, comparing against every key in constant time."""
    found = None
    for key, tenant in settings.api_keys.items():
        if hmac.compare_digest(key.encode(), presented.encode()):
            found = tenant
    return found


def bearer_token(request: Request) -> str:
    if len(request.headers.getlist("authorization")) > 1:  # a proxy and a client disagreeing: neither wins
        raise ApiError(400, "bad_request", "more than one Authorization header; send exactly one, "
                       "'Authorization: Bearer <key>'", headers=_UNAUTHORIZED_HEADERS)
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
    if settings.insecure_no_auth:  # serve --insecure-no-auth: one tenant, no keys (it said so at start)
        tenant: str | None = NO_AUTH_TENANT
    else:
        tenant = tenant_for_key(settings, bearer_token(request))
    if tenant is None:
        wait = _failures(request).fail(request.client.host if request.client else "")
        if wait:
            raise ApiError(429, "rate_limited", f"too many requests with a wrong API key from this address; retry "
                           f"in {wait} s with a valid key", headers={"Retry-After": str(wait)})
        raise ApiError(401, "unauthorized", "invalid API key", headers=_UNAUTHORIZED_HEADERS)
    request.state.tenant = tenant
    request.app.state.limits.request(tenant)  # 429 with Retry-After over the tenant's request rate
    return Tenant(name=tenant, client=request.app.state.client, settings=settings)
