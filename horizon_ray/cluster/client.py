"""The one object the API and the CLI use to talk to the coordinator.

`CoordinatorClient` is the interface. Two implementations:
- `LocalClient`: wraps an in-process `Coordinator` core (no Ray); API and unit tests use it with fake agents
  (see `horizon_ray.cluster.fake.make_local_client`).
- `RayClient`: calls the named, detached coordinator actor of a running cluster.

Every method is tenant-scoped except `nodes`, `queue(None)` and `ready`. A job of another tenant raises
`JobNotFound`, exactly like a job that does not exist. Errors are the typed ones of
`horizon_ray.cluster.errors` (JobRejected, QuotaExceeded, JobNotFound, InvalidTransition, InvalidSpec,
IdempotencyConflict, CoordinatorUnavailable).
"""

from __future__ import annotations

import builtins
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from horizon_ray.cluster.errors import CoordinatorUnavailable, HorizonError
from horizon_ray.cluster.messages import Checkpoint, JobEvent, JobRecord, JobStatus, NodeInfo

if TYPE_CHECKING:
    from horizon_ray.cluster.coordinator import Coordinator

_log = logging.getLogger("horizon_ray.cluster")
COORDINATOR_NAME = "horizon-coordinator"  # name of the detached coordinator actor
NAMESPACE = "horizon-ray"  # Ray namespace of the coordinator and the node agents


@runtime_checkable
class CoordinatorClient(Protocol):
    def submit(
        self,
        tenant: str,
        spec: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        priority: int = 0,
        name: str | None = None,
    ) -> JobRecord:
        """Create a job. Returns it QUEUED (or already RUNNING when a node had room).

        Raises InvalidSpec (bad spec), JobRejected (no node can ever hold it; details carry the reason and
        per-node verdicts), QuotaExceeded (tenant limit), IdempotencyConflict (same key, other spec).
        The same (tenant, idempotency_key) with the same spec returns the existing job.
        """
        ...

    def get(self, tenant: str, job_id: str) -> JobRecord:
        """One job. Raises JobNotFound (also for another tenant's job)."""
        ...

    def list(
        self,
        tenant: str,
        *,
        limit: int = 20,
        after: str | None = None,
        status: JobStatus | str | None = None,
    ) -> tuple[builtins.list[JobRecord], bool]:
        """The tenant's jobs, newest first; `after` is the id of the last job of the previous page.

        Returns (jobs, has_more).
        """
        ...

    def cancel(self, tenant: str, job_id: str) -> JobRecord:
        """Cancel in any non-terminal state: QUEUED/RECOVERING/VALIDATING -> CANCELLED at once,
        RUNNING/CHECKPOINTING -> CANCELLING (CANCELLED once the engine exited and the reservation is
        freed). Cancelling a CANCELLING or CANCELLED job returns it unchanged; a SUCCEEDED or FAILED job
        raises InvalidTransition."""
        ...

    def events(self, tenant: str, job_id: str, after_seq: int = 0, limit: int | None = None
               ) -> builtins.list[JobEvent]:
        """The job's events with seq > after_seq, oldest first; at most `limit` of them (None: all)."""
        ...

    def checkpoints(self, tenant: str, job_id: str) -> builtins.list[Checkpoint]:
        """The job's complete checkpoints, oldest first."""
        ...

    def plan(self, tenant: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Dry run of placement. Returns {"decision": "place"|"queue"|"reject", "node_id": best node or
        None, "reason": str, "plan": planner output for the best node (host_bytes, gpu_bytes, fits,
        reason, ...), "nodes": [{node_id, ram_bytes, free_bytes, fits, fits_now, host_bytes, gpu_bytes,
        reason}]}."""
        ...

    def nodes(self) -> builtins.list[NodeInfo]:
        """Every known node, alive or not, with its reservation ledger."""
        ...

    def queue(self, tenant: str | None = None) -> builtins.list[JobRecord]:
        """Waiting jobs (RECOVERING first, then QUEUED) in the order they will be served, each with its
        queue_position and queue_reason; only the tenant's when a tenant is given."""
        ...

    def ready(self) -> bool:
        """True when the coordinator answers and has loaded its job table."""
        ...


@dataclass(frozen=True)
class Reply:
    """The coordinator actor's answer to one call of the protocol: its value, or the domain error it raised
    (carried as data: a raised one would reach the client as Ray's task error)."""

    value: Any = None  # what the core's method returned, when error is None
    error: dict[str, Any] | None = None  # HorizonError.to_wire() of the refusal


class _Delegating:
    """The protocol's methods, each one `_call(name, ...)`: the in-process and the Ray client differ only
    in how a call reaches the coordinator."""

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def submit(self, tenant, spec, *, idempotency_key=None, priority=0, name=None) -> JobRecord:
        return self._call("submit", tenant, spec, idempotency_key=idempotency_key, priority=priority,
                          name=name)

    def get(self, tenant, job_id) -> JobRecord:
        return self._call("get", tenant, job_id)

    def list(self, tenant, *, limit=20, after=None, status=None):
        return self._call("list", tenant, limit=limit, after=after, status=status)

    def cancel(self, tenant, job_id) -> JobRecord:
        return self._call("cancel", tenant, job_id)

    def events(self, tenant, job_id, after_seq=0, limit=None):
        return self._call("events", tenant, job_id, after_seq, limit)

    def checkpoints(self, tenant, job_id):
        return self._call("checkpoints", tenant, job_id)

    def plan(self, tenant, spec):
        return self._call("plan", tenant, spec)

    def nodes(self):
        return self._call("nodes")

    def queue(self, tenant=None):
        return self._call("queue", tenant)


class LocalClient(_Delegating):
    """In-process client over a `Coordinator` core. Each call first runs one scheduling pass (`tick`),
    so tests see placements and agent reports without a background loop; `start_background(interval)`
    adds one for long-lived use."""

    def __init__(self, coordinator: Coordinator, *, tick_on_call: bool = True):
        self.coordinator = coordinator
        self._tick_on_call = tick_on_call
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._tick_on_call:
                self.coordinator.tick()
            result = getattr(self.coordinator, method)(*args, **kwargs)
            if method in ("submit", "cancel"):
                self.coordinator.tick()
                if isinstance(result, JobRecord):
                    result = self.coordinator.get(result.tenant, result.id)
            return result

    def ready(self) -> bool:
        return self._call("ready")

    def tick(self) -> None:
        with self._lock:
            self.coordinator.tick()

    def start_background(self, interval_s: float = 0.5) -> None:
        """Run `tick` every `interval_s` on a daemon thread until `close`."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.tick()

        self._thread = threading.Thread(target=loop, name="coordinator-tick", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.coordinator.close()


def connect_ray(address: str | None = None, namespace: str = NAMESPACE) -> None:
    """`ray.init` to the cluster at `address` (default "auto"), unless this process is connected already.

    A cluster bound to a loopback address (one machine, e.g. `serve --simulate-nodes`) must be joined on
    loopback too: Ray otherwise rewrites 127.0.0.1 to the machine's outside address and never reaches the
    GCS. Ray reads that choice (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) when it is first imported, so it is
    set here only if this process has not imported Ray yet.
    """
    address = address or "auto"
    host = address.rsplit(":", 1)[0] if ":" in address else ""
    if host in ("127.0.0.1", "localhost") and "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if not ray.is_initialized():
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        except ConnectionError:
            if not _enable_ray_token_auth():
                raise
            ray.init(address=address, namespace=namespace, log_to_driver=False)


def _enable_ray_token_auth() -> bool:
    """Switch this process to Ray's token authentication when a token is at hand and no mode is set.

    `ray start` turns token authentication on for a cluster once ~/.ray/auth_token exists (a local
    `ray.init()` writes one), but `ray.init(address=...)` with an explicit address does not read it unless
    RAY_AUTH_MODE=token: it then cannot connect. Ray's own check (its CLI's) decides."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return False
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


class RayClient(_Delegating):
    """Client of the named, detached coordinator actor.

    Connects to Ray at `address` ("auto", "ray://...", or None for the already initialised one) in the
    coordinator's namespace. Domain errors come back as plain data and are re-raised as their typed class;
    an unreachable coordinator raises CoordinatorUnavailable.

    A long-lived client (the API) survives the loss of the cluster's head: when a call finds the connection
    gone (the head restarted: a Ray Client session does not outlive its server), the client drops it and
    connects again on a background thread, answering CoordinatorUnavailable (`ready()` False) until it is
    back. With `lazy`, the first connection is made that way too, so the process starts before the head.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str = COORDINATOR_NAME,
        namespace: str = NAMESPACE,
        timeout_s: float = 60.0,
        lazy: bool = False,
        retry_s: float = 2.0,
        credential: str | None = None,
    ):
        self._credential = credential  # presented on every call: a tenant's API key, or the API's (gate.py)
        self._address = address
        self._name = name
        self._namespace = namespace
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._actor: Any = None  # the coordinator actor's Ray handle, once found
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._connector: threading.Thread | None = None
        self._last_error = "not connected yet"
        # a connection this process made before (serve's driver) is its owner's to keep: no reconnecting it
        # (ray is not imported here: connect_ray must see it unimported to choose loopback)
        ray = sys.modules.get("ray")
        self._owns_connection = lazy or ray is None or not ray.is_initialized()
        if lazy:
            self._reconnect("starting")
        else:
            connect_ray(address, namespace)
            self._connected.set()

    def _reconnect(self, why: str) -> None:
        """Drop the connection and connect again on a background thread (one at a time)."""
        with self._lock:
            self._connected.clear()
            self._actor = None
            self._last_error = why
            if self._connector is not None and self._connector.is_alive():
                return
            self._connector = threading.Thread(target=self._connect_loop, name="ray-reconnect", daemon=True)
            self._connector.start()

    def _connect_loop(self) -> None:
        import ray

        failures = 0
        while not self._connected.is_set():
            try:
                if ray.is_initialized():
                    ray.shutdown()
                _drop_client_sessions()
                connect_ray(self._address, self._namespace)
                self._connected.set()
                if failures:
                    _log.warning("connected to the Ray cluster at %s again", self._address or "auto")
            except Exception as exc:  # noqa: BLE001 - not up yet: try again
                self._last_error = _first_line(exc)
                if failures % 30 == 0:  # the first failure, then one line a minute or so
                    _log.warning("cannot connect to the Ray cluster at %s (%s); retrying every %.0f s",
                                 self._address or "auto", self._last_error, self._retry_s)
                failures += 1
                time.sleep(self._retry_s)

    def _handle(self):
        import ray

        if not self._connected.is_set():
            raise CoordinatorUnavailable(f"not connected to the Ray cluster at {self._address or 'auto'} "
                                         f"({self._last_error}); retrying")
        if self._actor is None:
            try:
                self._actor = ray.get_actor(self._name, namespace=self._namespace)
            except ValueError as exc:
                raise CoordinatorUnavailable(f"no coordinator actor {self._name!r} is running") from exc
        return self._actor

    def _call(self, method: str, *args: Any, _timeout_s: float | None = None, **kwargs: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            reply = ray.get(getattr(self._handle(), method).remote(*args, _credential=self._credential, **kwargs),
                            timeout=_timeout_s or self._timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            self._actor = None
            raise CoordinatorUnavailable(f"coordinator did not answer {method}: {exc}") from exc
        except (CoordinatorUnavailable, RayTaskError):
            raise  # a RayTaskError is the coordinator's own crash: the connection is fine
        except Exception as exc:  # noqa: BLE001 - the connection itself is gone (e.g. the head restarted)
            if not self._owns_connection:
                raise
            self._reconnect(f"lost the connection: {_first_line(exc)}")
            raise CoordinatorUnavailable(f"lost the Ray cluster at {self._address or 'auto'} during {method} "
                                         f"({_first_line(exc)}); reconnecting") from exc
        if reply.error is not None:
            raise HorizonError.from_wire(reply.error)
        return reply.value

    def ready(self) -> bool:
        try:
            return bool(self._call("ready", _timeout_s=10.0))  # a probe: answer fast
        except CoordinatorUnavailable:
            return False

    def whoami(self) -> str | None:
        """The tenant this client's credential acts as (None: the API's, which names the tenant of each call).
        Raises Unauthorized for a missing or unknown key."""
        return self._call("whoami")


def _drop_client_sessions() -> None:
    """Forget a Ray Client session whose server went away: Ray keeps it registered (ray.is_initialized() is
    False, yet a new ray.init refuses: "The client has already connected to the cluster ...")."""
    import ray.util.client

    if ray.util.client.num_connected_contexts() > 0:
        ray.util.client.ray.disconnect()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0][:300] if lines else "") or type(exc).__name__
