"""The Ray side: node agents pinned to their nodes, the named detached coordinator, and how to start them.

- One `NodeAgent` actor per node, named `horizon-agent:<node>` in namespace `horizon-ray`, pinned with
  `NodeAffinitySchedulingStrategy(soft=False)`, taking no CPU (its jobs run in its child processes).
- One `CoordinatorActor`, named `horizon-coordinator`, detached, restarted by Ray when it dies
  (`max_restarts=-1`); it reloads its sqlite job table and finds the agents by name, so a restart loses
  no job. It is pinned to the head node, whose disk holds the job table. Its methods are the client protocol's,
  run concurrently (the core holds its own lock); its tick loop polls the agents, so that no call waits on a
  node.

Simulated nodes (`horizon-ray serve --simulate-nodes a=16GiB,b=512GiB:2gpu,...`): every Ray node carries a
custom resource `horizon_node_<name>` and its agent declares the given RAM, logical GPUs and cores to the
planner. The agent takes no GPU from Ray: it hands the node's GPUs out to its engines itself.

Real nodes (a KubeRay pod): the agent offers the node's RAM less Ray's share of it (the node's object store and
`RAY_PROCESSES_BYTES`), keeps the thread variables the node's container sets, and, with `skip_head`, no agent
runs on the head (a head without job capacity: no data volumes, the GCS beside it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnschedulableError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horizon_ray.cluster.agent import RAY_PROCESSES_BYTES, THREAD_VARS, NodeAgent
from horizon_ray.cluster.agent_protocol import ENGINE_LEASE_S, AgentUnavailable
from horizon_ray.cluster.client import COORDINATOR_NAME, NAMESPACE, Reply
from horizon_ray.cluster.coordinator import Coordinator
from horizon_ray.cluster.errors import HorizonError
from horizon_ray.cluster.gate import OPEN_TENANT, Gate, GateConfig, Principal
from horizon_ray.cluster.messages import AgentJobReport, JobStatus, Launch, NodeInfo, Reservation
from horizon_ray.cluster.nodes import parse_node_value
from horizon_ray.cluster.tenants import TenantsConfig

AGENT_PREFIX = "horizon-agent:"  # + logical node name
NODE_RESOURCE_PREFIX = "horizon_node_"  # + logical node name: custom resource of a simulated node
COORDINATOR_LOG = "coordinator.log"  # beside the job table: the coordinator's log, which `serve` prints
LOG_FORMAT = "%(asctime)s %(levelname)s coordinator: %(message)s"
log = logging.getLogger("horizon_ray.cluster")


def coordinator_log_path(store_path: str | Path) -> Path:
    """Where the coordinator of the job table `store_path` writes its log."""
    return Path(store_path).with_name(COORDINATOR_LOG)


def log_to_file(path: Path, max_bytes: int = 16 << 20) -> None:
    """Send this process's `horizon_ray.cluster` log (INFO and up: nodes lost and back, jobs placed, recovering,
    waiting and why) to `path`, and its warnings to stderr (Ray's log of the worker). The coordinator actor runs
    on the head, where no one reads its stderr; `serve` prints the file (it sits on the service root, which a
    KubeRay head's horizon-control container mounts too)."""
    if any(getattr(h, "baseFilename", None) == str(path) for h in log.handlers):
        return
    try:
        handler: logging.Handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=1, encoding="utf-8")
    except OSError as exc:
        print(f"coordinator: cannot write its log to {path}: {exc}; warnings go to stderr only", file=sys.stderr)
    else:
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.setLevel(logging.INFO)
        log.addHandler(handler)
    if not any(type(h) is logging.StreamHandler for h in log.handlers):
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setFormatter(logging.Formatter(LOG_FORMAT))
        stderr.setLevel(logging.WARNING)
        log.addHandler(stderr)
    log.setLevel(logging.INFO)
    log.propagate = False


class RayAgentProxy:
    """The coordinator's `Agent` over a NodeAgent actor handle. What the agent's own code raises comes back as it
    is (a `RayTaskError` that is also the agent's exception: ReservationRefused, a failed launch); every failure of
    Ray to deliver the call or its answer is AgentUnavailable, never an error of the job it was about: definitive
    when the agent can never answer again (it died, or its node is gone and the actor is pinned there)."""

    def __init__(self, handle: Any, node_id: str, timeout_s: float = 5.0):
        self.handle = handle
        self.node_id = node_id
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return ray.get(getattr(self.handle, method).remote(*args, **kwargs), timeout=self.timeout_s)
        except RayTaskError as exc:  # the agent's method raised it: its exception (the remote traceback in the log)
            if isinstance(exc.cause, Exception):
                log.debug("agent %s: %s raised %s", self.node_id, method, exc)
                raise exc.cause from None
            raise
        except (ActorDiedError, ActorUnschedulableError) as exc:
            # ActorUnschedulableError: the agent is pinned to its node (NodeAffinity, soft=False) and the node is
            # gone, so Ray cannot restart it anywhere; Ray says so for a while before the actor's name goes.
            # The reason reaches tenants (a job's status event): Ray's text (actor ids, addresses) goes to the log.
            log.warning("agent %s is gone (%s on %s): %s", self.node_id, type(exc).__name__, method, exc)
            raise AgentUnavailable(f"its agent died ({type(exc).__name__})", definitive=True) from None
        except RayError as exc:  # RayActorError (ActorUnavailableError ...), GetTimeoutError, RaySystemError, ...
            log.warning("agent %s did not answer %s: %s: %s", self.node_id, method, type(exc).__name__, exc)
            raise AgentUnavailable(f"its agent did not answer ({type(exc).__name__})") from None

    def info(self) -> NodeInfo:
        return self._call("info")

    def start(self, launch: Launch) -> Reservation:
        return self._call("start", launch)

    def cancel(self, job_id: str) -> None:
        return self._call("cancel", job_id)

    def poll(self, offsets: dict[str, int]) -> dict[str, AgentJobReport]:
        return self._call("poll", offsets)

    def forget(self, job_id: str) -> None:
        return self._call("forget", job_id)


class AgentDirectory:
    """The live agents, found by name in the namespace (new nodes' agents appear, dead ones vanish)."""

    def __init__(self, timeout_s: float = 5.0):
        self._timeout_s = timeout_s
        self._proxies: dict[str, RayAgentProxy] = {}

    def __call__(self) -> dict[str, RayAgentProxy]:
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE and a["name"].startswith(AGENT_PREFIX)}
        current: dict[str, RayAgentProxy] = {}
        for name in names:
            node_id = name[len(AGENT_PREFIX):]
            proxy = self._proxies.get(node_id)
            if proxy is None:
                try:
                    handle = ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:
                    continue
                proxy = RayAgentProxy(handle, node_id, self._timeout_s)
            current[node_id] = proxy
        self._proxies = current
        return dict(current)


CALLS_AT_ONCE = 32  # the coordinator actor's max_concurrency: API calls answered while others wait


class CoordinatorActor:
    """The Ray actor around the `Coordinator` core: the client protocol's methods (see
    `client.CoordinatorClient`), each answering a `Reply`, and a tick loop on a thread. A submit or a cancel
    wakes the loop rather than running a pass itself, so that it answers at once whatever the nodes do."""

    def __init__(self, store_path: str, jobs_root: str, tenants_file: str | None = None,
                 tick_interval_s: float = 0.5, node_dead_after_s: float = 10.0, planner: str | None = None,
                 gate: dict[str, Any] | None = None):
        # every client call passes the gate (None: a coordinator of tests, which trusts the tenant it is told)
        self.gate = Gate(GateConfig.from_wire(gate)) if gate is not None else None
        log_to_file(coordinator_log_path(store_path))
        kwargs: dict[str, Any] = {}
        if planner:
            kwargs["planner"] = _import(planner)
        self.core = Coordinator(store_path=store_path, jobs_root=jobs_root, agents=AgentDirectory(),
                                tenants=TenantsConfig.load(tenants_file), node_dead_after_s=node_dead_after_s,
                                **kwargs)
        log.info("coordinator started (pid %d): job table %s, node lost after %.0f s without an answer",
                 os.getpid(), store_path, node_dead_after_s)
        self._interval = tick_interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by submit and cancel: the next pass starts now
        self._thread = threading.Thread(target=self._loop, name="coordinator-tick", daemon=True)
        self._thread.start()

    # Each method is the client protocol's (client.CoordinatorClient) plus `_credential`, what the caller presents
    # at the gate (RayClient adds it to every call).

    def submit(self, tenant: str, spec: dict[str, Any], *, idempotency_key: str | None = None,
               priority: int = 0, name: str | None = None, _credential: str | None = None) -> Reply:
        reply = self._serve("submit", _credential, tenant, spec, idempotency_key=idempotency_key,
                            priority=priority, name=name)
        self._wake.set()  # placed by the pass this starts, not by this call: one slow node stalls no caller
        return reply

    def get(self, tenant: str, job_id: str, *, _credential: str | None = None) -> Reply:
        return self._serve("get", _credential, tenant, job_id)

    def list(self, tenant: str, *, limit: int = 20, after: str | None = None,
             status: JobStatus | str | None = None, _credential: str | None = None) -> Reply:
        return self._serve("list", _credential, tenant, limit=limit, after=after, status=status)

    def cancel(self, tenant: str, job_id: str, *, _credential: str | None = None) -> Reply:
        reply = self._serve("cancel", _credential, tenant, job_id)
        self._wake.set()  # the pass this starts sees the engine stop
        return reply

    def events(self, tenant: str, job_id: str, after_seq: int = 0, limit: int | None = None, *,
               _credential: str | None = None) -> Reply:
        return self._serve("events", _credential, tenant, job_id, after_seq, limit)

    def checkpoints(self, tenant: str, job_id: str, *, _credential: str | None = None) -> Reply:
        return self._serve("checkpoints", _credential, tenant, job_id)

    def plan(self, tenant: str, spec: dict[str, Any], *, _credential: str | None = None) -> Reply:
        return self._serve("plan", _credential, tenant, spec)

    def nodes(self, *, _credential: str | None = None) -> Reply:
        return self._serve("nodes", _credential)

    def queue(self, tenant: str | None = None, *, _credential: str | None = None) -> Reply:
        return self._serve("queue", _credential, tenant)

    def ready(self, *, _credential: str | None = None) -> Reply:
        return self._serve("ready", _credential)

    def whoami(self, *, _credential: str | None = None) -> Reply:
        """The tenant `_credential` acts as (None: the API's, which names the tenant of each call)."""
        return self._serve("whoami", _credential)

    def _serve(self, method: str, credential: str | None, *args: Any, **kwargs: Any) -> Reply:
        """The core's `method` as the principal of `credential` (see `gate`); a domain error it raises comes
        back as data (see RayClient). The one place every call passes."""
        try:
            who = Principal(OPEN_TENANT)
            if self.gate is not None:
                who, args, kwargs = self.gate.admit(method, args, kwargs, credential)
            if method == "whoami":
                return Reply(value=who.tenant)
            result = getattr(self.core, method)(*args, **kwargs)
            if self.gate is not None:
                result = self.gate.shown(who, method, result)
            return Reply(value=result)
        except HorizonError as exc:
            return Reply(error=exc.to_wire())

    def tick(self) -> None:
        """One pass now (start-up and benchmarks wait for it: afterwards the coordinator knows every agent)."""
        self.core.tick()

    def pid(self) -> int:
        """The actor's process id (tests use it to see a restart)."""
        return os.getpid()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
                self.core.tick()
            except Exception:  # noqa: BLE001 - the loop must survive one bad pass; it is logged
                log.exception("coordinator tick failed")


def node_name_of(node: dict[str, Any]) -> str:
    """Logical name of a Ray node: its `horizon_node_<name>` resource, else the first 12 hex of its id."""
    for key in node.get("Resources", {}):
        if key.startswith(NODE_RESOURCE_PREFIX):
            return key[len(NODE_RESOURCE_PREFIX):]
    return node["NodeID"][:12]


HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node


def agent_nodes(nodes: list[dict[str, Any]], declared: set[str] | None = None, *, only_simulated: bool = False,
                skip_head: bool = False) -> list[dict[str, Any]]:
    """The alive Ray nodes (entries of `ray.nodes()`) that get an agent: with `only_simulated`, those named in
    `declared`; with `skip_head`, not the head."""
    out = []
    for node in nodes:
        if not node.get("Alive"):
            continue
        if only_simulated and node_name_of(node) not in (declared or set()):
            continue
        if skip_head and HEAD_RESOURCE in node.get("Resources", {}):
            continue
        out.append(node)
    return out


def ray_reserved_bytes(node: dict[str, Any]) -> int:
    """What Ray itself takes of a node's RAM: its object store and its processes."""
    return int(node.get("Resources", {}).get("object_store_memory", 0)) + RAY_PROCESSES_BYTES


def ensure_agents(ram_by_node: Mapping[str, Any] | None = None, *, command: list[str] | None = None,
                  env: dict[str, str] | None = None, only_simulated: bool = False,
                  skip_head: bool = False, engine_lease_s: float = ENGINE_LEASE_S) -> dict[str, Any]:
    """Start a NodeAgent on every alive Ray node that has none; returns node name -> handle.

    `ram_by_node`: what simulated nodes declare (by logical name): bytes of RAM or a `local.SimulatedNode`
    (RAM, logical GPUs, cores); other nodes report their real RAM (less Ray's share), GPUs (nvidia-smi) and
    cores. `only_simulated`: skip nodes without a `horizon_node_*` resource (the head of a simulated cluster).
    `skip_head`: no agent on the head node (jobs run on worker nodes only). `engine_lease_s`: how long an
    agent's engines outlive the coordinator's last call (NodeAgent's lease_s).
    """
    declared = {name: parse_node_value(name, value) for name, value in (ram_by_node or {}).items()}
    handles = {}
    for node in agent_nodes(ray.nodes(), set(declared), only_simulated=only_simulated, skip_head=skip_head):
        name = node_name_of(node)
        sim = declared.get(name)
        handles[name] = NodeAgentActor.options(
            name=AGENT_PREFIX + name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(name, ram_bytes=sim.ram_bytes if sim else None, gpu_count=sim.gpu_count if sim else None,
                 gpu_memory_bytes=sim.gpu_memory_bytes if sim else None, cpu_count=sim.cpu_count if sim else None,
                 ray_node_id=node["NodeID"], command=command, env=env,
                 ray_reserved_bytes=0 if sim else ray_reserved_bytes(node), lease_s=engine_lease_s, probe=True)
    for handle in handles.values():
        ray.get(handle.ping.remote(), timeout=120)  # type: ignore[attr-defined]  # ray's handle stubs lack .remote
    return handles


def start_coordinator(store_path: str | Path, jobs_root: str | Path, *, tenants_file: str | None = None,
                      node_dead_after_s: float = 10.0, planner: str | None = None,
                      gate: GateConfig | None = None) -> Any:
    """The coordinator actor (started if none runs), pinned to the head node; waits until it answers. `gate`:
    what it admits (None: it trusts the tenant each call names)."""
    head = _head_node_id()
    handle = CoordinatorActorRemote.options(
        name=COORDINATOR_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_concurrency=CALLS_AT_ONCE,
        # A call cut by a crash is not replayed (a replayed submit would create a second job); the client
        # sees CoordinatorUnavailable and retries what is safe to retry.
        max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False),
    ).remote(str(store_path), str(jobs_root), tenants_file, 0.5, node_dead_after_s, planner,
             gate.to_wire() if gate is not None else None)
    deadline = time.time() + 120
    while True:
        try:
            ray.get(handle.ready.remote(), timeout=30)  # type: ignore[attr-defined]  # ray's handle stubs lack .remote
            return handle
        except RayActorError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def _head_node_id() -> str:
    gcs = ray.get_runtime_context().gcs_address
    host_port = gcs.rsplit(":", 1)
    for node in ray.nodes():
        if node.get("Alive") and node.get("NodeManagerAddress") == host_port[0] and \
                "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def _import(path: str) -> Any:
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def node_thread_vars(ppid: int | None = None) -> dict[str, str]:
    """The thread variables (OMP_NUM_THREADS, ...) of the environment this Ray node was started with: its
    raylet's, the parent of every Ray worker process. Ray puts OMP_NUM_THREADS=1 in the environment of an actor
    that takes no CPU (this agent) unless the node's environment sets it, so the agent's own environment
    cannot tell Ray's 1 from a value the container sets."""
    try:
        raw = Path(f"/proc/{ppid or os.getppid()}/environ").read_bytes()
    except OSError:
        return {}
    env = dict(item.split("=", 1) for item in raw.decode("utf-8", "replace").split("\0") if "=" in item)
    return {k: env[k] for k in THREAD_VARS if env.get(k)}


class RayNodeAgent(NodeAgent):
    """The NodeAgent as a Ray actor: the thread variables its node's container sets are kept for every engine
    (an explicit `env` still wins)."""

    def __init__(self, node_id: str, **kwargs: Any):
        kwargs["env"] = {**node_thread_vars(), **(kwargs.get("env") or {})}
        super().__init__(node_id, **kwargs)


NodeAgentActor = ray.remote(RayNodeAgent)
CoordinatorActorRemote = ray.remote(CoordinatorActor)
