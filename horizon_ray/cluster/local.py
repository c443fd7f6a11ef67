"""Starting the service on a Ray cluster: a local cluster of simulated nodes, the agents and the coordinator.

Used by `horizon-ray serve`, the demo and the integration tests, so all run the same code::

    nodes = parse_simulated_cluster("a=16GiB,b=512GiB:2gpu")           # or {"a": 16 * GiB, ...}
    with simulated_service(root, nodes) as (cluster, service):         # real Ray nodes on this machine
        ...                                                            # stopped on the way out

or, step by step: ``start_simulated_cluster(nodes)``, ``ray.init(address=cluster.address,
namespace=NAMESPACE)``, ``start_service(root, ram_by_node=nodes)``, then ``stop_service()``,
``cluster.shutdown()``.

A simulated node is declared as in `cluster/nodes.py` (`a=16GiB,b=512GiB:4gpu`).
"""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizon_ray.cluster.client import COORDINATOR_NAME, NAMESPACE
from horizon_ray.cluster.gate import GateConfig
from horizon_ray.cluster.nodes import SimulatedNode, parse_node_value
from horizon_ray.cluster.ray_actors import (
    AGENT_PREFIX,
    NODE_RESOURCE_PREFIX,
    ensure_agents,
    start_coordinator,
)
from horizon_ray.errors import BadInput

ADDRESS_FILE = "ray_address"  # under the service root: the GCS address of the cluster serve runs on
STORE_NAME = "coordinator.sqlite"  # under the service root: the job table
RAY_TOKEN_FILE = "ray_token"  # under the service root: the Ray token of the cluster serve starts (0600)
RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"  # Ray's token authentication


def use_ray_token(root: Path, *, create: bool) -> Path | None:
    """Turn on Ray's token authentication in this process (and every process it starts: the Ray cluster, a
    client) with the token file under the service `root`: made with a random token, readable by this user
    only, when `create` and missing. Returns its path, or None (no token there and not `create`; an explicit
    RAY_AUTH_MODE is left as it is).

    The environment names the file, not the token: Ray's processes read it from there, and the engines, which
    start from an allow-list environment (`engine_env`), get neither."""
    import secrets

    path = Path(root) / RAY_TOKEN_FILE
    if os.environ.get(RAY_AUTH_MODE) not in (None, "token"):
        return None
    if os.environ.get(RAY_AUTH_MODE) == "token" and (os.environ.get("RAY_AUTH_TOKEN") or
                                                     os.environ.get(RAY_AUTH_TOKEN_PATH, str(path)) != str(path)):
        return None  # an operator's own token (a k8s Secret): that one
    if not path.is_file():
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # another serve of this root made it first
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    mode = os.lstat(path).st_mode
    if mode & 0o077 or not stat.S_ISREG(mode):
        raise BadInput(f"the Ray token {path} is readable by others or not a plain file; chmod 600 it (or delete it "
                       "and serve makes a new one)")
    os.environ[RAY_AUTH_MODE] = "token"
    os.environ[RAY_AUTH_TOKEN_PATH] = str(path)
    if "ray" in sys.modules:  # Ray reads its configuration once: tell it again
        from ray._raylet import Config  # type: ignore[attr-defined]  # ray._raylet (Cython) has no stub for it

        Config.initialize("")
    return path


def start_simulated_cluster(ram_by_node: Mapping[str, int | SimulatedNode], *, head_cpus: int = 1,
                            node_cpus: int = 1, dashboard_port: int | None = None, port: int | None = None) -> Any:
    """A `ray.cluster_utils.Cluster` on this machine: a head (coordinator, API) plus one Ray node per
    simulated node, each carrying the custom resource `horizon_node_<name>` its agent is pinned by and its
    logical GPUs (`num_gpus`). `ram_by_node`: bytes of RAM or a SimulatedNode per node. `dashboard_port`: run
    Ray's dashboard and job server there (`ray job submit` needs it); None: none. `port`: the head's GCS
    port (None: a free one)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray.cluster_utils import Cluster

    head = _head_args(dashboard_port, port, num_cpus=head_cpus)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    try:
        for name, value in ram_by_node.items():
            add_simulated_node(cluster, name, node_cpus=node_cpus, wait=False,
                               gpus=parse_node_value(name, value).gpu_count)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def start_local_cluster(*, dashboard_port: int | None = None, port: int | None = None) -> Any:
    """A one-node Ray cluster of this machine as it is (its cores, GPUs and RAM), started like a simulated one
    so that its ports can be chosen: `port` for the head's GCS (None: a free one), `dashboard_port` for Ray's
    dashboard and job server (None: none)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray.cluster_utils import Cluster

    head = _head_args(dashboard_port, port, num_cpus=len(os.sched_getaffinity(0)))
    return Cluster(initialize_head=True, connect=False, head_node_args=head)


def _head_args(dashboard_port: int | None, port: int | None, *, num_cpus: int) -> dict[str, Any]:
    """The head's Ray parameters: the dashboard (and so the job server) on `dashboard_port` at 127.0.0.1, its
    agent on a free port (Ray's fixed default clashes with any other cluster on the machine, and without its
    agent the job server takes no job), the GCS on `port` (None: a free one)."""
    head: dict[str, Any] = {"num_cpus": num_cpus, "include_dashboard": dashboard_port is not None,
                            "dashboard_agent_listen_port": None}
    if dashboard_port is not None:
        head.update(dashboard_port=dashboard_port, dashboard_host="127.0.0.1")
    if port is not None:
        head["gcs_server_port"] = port
    return head


def add_simulated_node(cluster: Any, name: str, *, node_cpus: int = 1, wait: bool = True, gpus: int = 0) -> Any:
    """Add one simulated node to a local cluster; its agent is started by `ensure_agents`. `gpus`: logical
    GPUs declared to Ray (the agent takes none of them: it hands them out to its engines itself)."""

    return cluster.add_node(num_cpus=node_cpus, num_gpus=gpus, resources={NODE_RESOURCE_PREFIX + name: 1},
                            wait=wait)


@dataclass
class Service:
    """Handles of a started service."""

    coordinator: Any  # the coordinator actor
    agents: dict[str, Any]  # node name -> agent actor
    store_path: Path  # the job table
    jobs_root: Path  # default parent of job outputs


def start_service(root: str | Path, *, ram_by_node: Mapping[str, int | SimulatedNode] | None = None,
                  tenants_file: str | Path | None = None, node_dead_after_s: float = 10.0,
                  agent_env: dict[str, str] | None = None, planner: str | None = None,
                  skip_head: bool = False, jobs_root: str | Path | None = None,
                  engine_lease_s: float | None = None, agent_command: list[str] | None = None,
                  gate: GateConfig | None = None) -> Service:
    """Agents on every node (only the simulated ones when `ram_by_node` is given: bytes of RAM or a
    SimulatedNode per node; not on the head with `skip_head`) and the coordinator. `engine_lease_s`: how long an
    agent's engines outlive the coordinator's last call (default agent.ENGINE_LEASE_S); `agent_command`: the argv
    prefix of an engine (default `python -m horizon_ray.job`; benchmarks give a stand-in); `gate`: what the
    coordinator admits (`horizon_ray.cluster.gate`; None: it trusts the tenant each call names, for tests).

    Needs `ray.init` done. The job table is `<root>/coordinator.sqlite`; jobs without an output_dir write
    to `<jobs_root>/<tenant>/<job_id>/` (default jobs_root: `<root>/jobs`).
    """

    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    lease = {} if engine_lease_s is None else {"engine_lease_s": engine_lease_s}
    agents = ensure_agents(ram_by_node, env=agent_env, only_simulated=bool(ram_by_node), skip_head=skip_head,
                           command=agent_command, **lease)
    store = root / STORE_NAME
    jobs = Path(jobs_root).expanduser().resolve() if jobs_root is not None else root / "jobs"
    coordinator = start_coordinator(store, jobs, tenants_file=str(tenants_file) if tenants_file else None,
                                    node_dead_after_s=node_dead_after_s, planner=planner, gate=gate)
    import ray

    ray.get(coordinator.tick.remote(), timeout=120)  # so that it knows every agent before serving
    (root / ADDRESS_FILE).write_text(ray.get_runtime_context().gcs_address + "\n")
    return Service(coordinator=coordinator, agents=agents, store_path=store, jobs_root=jobs)


def stop_service(timeout_s: float = 30.0) -> None:
    """Kill the coordinator and every agent of the connected cluster (their engines die with them)."""
    import ray


    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE
             and (a["name"] == COORDINATOR_NAME or a["name"].startswith(AGENT_PREFIX))]
    # the coordinator first: were it still ticking, it would record the engines the agents stop as ended
    # (a later `serve` on the same store resumes them instead)
    names.sort(key=lambda n: n != COORDINATOR_NAME)
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        if name.startswith(AGENT_PREFIX):
            try:
                ray.get(handle.shutdown.remote(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - a dead agent has nothing left to stop
                pass
        ray.kill(handle, no_restart=True)


@contextmanager
def simulated_service(root: str | Path, nodes: Mapping[str, int | SimulatedNode], *, logging_level: str | None = None,
                      **service: Any) -> Iterator[tuple[Any, Service]]:
    """A local cluster of simulated `nodes`, this process connected to it, agents and coordinator started
    (``start_service(root, ram_by_node=nodes, **service)``); everything stopped on the way out. Yields
    (cluster, service)."""
    import ray


    cluster = start_simulated_cluster(nodes)
    try:
        extra: dict[str, Any] = {"logging_level": logging_level} if logging_level else {}
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, **extra)
        yield cluster, start_service(root, ram_by_node=nodes, **service)
    finally:
        try:
            stop_service()
        finally:
            ray.shutdown()
            cluster.shutdown()


def resolve_address(address: str | None = None, root: str | Path | None = None) -> str:
    """The Ray address a client should use: the argument, $HORIZON_RAY_ADDRESS, $RAY_ADDRESS, the address
    `serve` wrote under `root`, or "auto"."""
    if address:
        return address
    for var in ("HORIZON_RAY_ADDRESS", "RAY_ADDRESS"):
        if os.environ.get(var):
            return os.environ[var]
    candidates = [Path(root).expanduser()] if root else []
    candidates.append(default_root())
    for r in candidates:
        f = r / ADDRESS_FILE
        if f.is_file() and f.read_text().strip():
            return f.read_text().strip()
    return "auto"


def default_root() -> Path:
    """`$HORIZON_RAY_HOME/service` (default `~/.cache/horizon-ray/service`)."""
    from horizon_ray.home import service_root

    return service_root()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.25, what: str = "condition") -> Any:
    """Poll `predicate` until it returns a truthy value; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
