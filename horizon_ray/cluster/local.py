"""Starting the service on a Ray cluster: a local cluster of simulated nodes, the agents and the coordinator.

Used by `horizon-ray serve` and by the integration tests, so both run the same code::

    cluster = start_simulated_cluster({"a": 16 * GiB, "b": 64 * GiB})   # real Ray nodes on this machine
    ray.init(address=cluster.address, namespace=NAMESPACE)
    service = start_service(root, ram_by_node={"a": 16 * GiB, "b": 64 * GiB})
    ...
    stop_service()
    cluster.shutdown()
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizon_ray.cluster.tenants import parse_bytes

ADDRESS_FILE = "ray_address"  # under the service root: the GCS address of the cluster serve runs on
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")


def parse_simulated_nodes(text: str) -> dict[str, int]:
    """ "a=16GiB,b=64GiB" -> {"a": 17179869184, "b": 68719476736}. Raises ValueError naming the fix."""
    nodes: dict[str, int] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, size = item.partition("=")
        name = name.strip()
        if not sep or not _NODE_NAME.match(name):
            raise ValueError(f"--simulate-nodes entry {item!r} is not NAME=SIZE; write e.g. a=16GiB,b=64GiB "
                             "(names: letters, digits, '_', '-')")
        if name in nodes:
            raise ValueError(f"--simulate-nodes names node {name!r} twice; give each node its own name")
        nodes[name] = parse_bytes(size.strip(), what=f"the RAM of node {name}")
        if nodes[name] <= 0:
            raise ValueError(f"node {name} has no RAM; give it a size like 16GiB")
    if not nodes:
        raise ValueError("--simulate-nodes is empty; write e.g. a=16GiB,b=64GiB")
    return nodes


def start_simulated_cluster(ram_by_node: dict[str, int], *, head_cpus: int = 1, node_cpus: int = 1,
                            include_dashboard: bool = False) -> Any:
    """A `ray.cluster_utils.Cluster` on this machine: a head (coordinator, API) plus one Ray node per
    simulated node, each carrying the custom resource `horizon_node_<name>` its agent is pinned by."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": head_cpus, "include_dashboard": include_dashboard})
    try:
        for name in ram_by_node:
            add_simulated_node(cluster, name, node_cpus=node_cpus, wait=False)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def add_simulated_node(cluster: Any, name: str, *, node_cpus: int = 1, wait: bool = True) -> Any:
    """Add one simulated node to a local cluster; its agent is started by `ensure_agents`."""
    from horizon_ray.cluster.ray_actors import NODE_RESOURCE_PREFIX

    return cluster.add_node(num_cpus=node_cpus, resources={NODE_RESOURCE_PREFIX + name: 1}, wait=wait)


@dataclass
class Service:
    """Handles of a started service."""

    coordinator: Any  # the coordinator actor
    agents: dict[str, Any]  # node name -> agent actor
    store_path: Path  # the job table
    jobs_root: Path  # default parent of job outputs


def start_service(root: str | Path, *, ram_by_node: dict[str, int] | None = None,
                  tenants_file: str | Path | None = None, node_dead_after_s: float = 10.0,
                  agent_env: dict[str, str] | None = None, planner: str | None = None) -> Service:
    """Agents on every node (only the simulated ones when `ram_by_node` is given) and the coordinator.

    Needs `ray.init` done. The job table is `<root>/coordinator.sqlite`; jobs without an output_dir write
    to `<root>/jobs/<tenant>/<job_id>/`.
    """
    from horizon_ray.cluster.ray_actors import ensure_agents, start_coordinator

    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    agents = ensure_agents(ram_by_node, env=agent_env, only_simulated=bool(ram_by_node))
    store, jobs = root / "coordinator.sqlite", root / "jobs"
    coordinator = start_coordinator(store, jobs, tenants_file=str(tenants_file) if tenants_file else None,
                                    node_dead_after_s=node_dead_after_s, planner=planner)
    import ray

    ray.get(coordinator.tick.remote(), timeout=120)  # so that it knows every agent before serving
    (root / ADDRESS_FILE).write_text(ray.get_runtime_context().gcs_address + "\n")
    return Service(coordinator=coordinator, agents=agents, store_path=store, jobs_root=jobs)


def stop_service(timeout_s: float = 30.0) -> None:
    """Kill the coordinator and every agent of the connected cluster (their engines die with them)."""
    import ray

    from horizon_ray.cluster.client import COORDINATOR_NAME, NAMESPACE
    from horizon_ray.cluster.ray_actors import AGENT_PREFIX

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE
             and (a["name"] == COORDINATOR_NAME or a["name"].startswith(AGENT_PREFIX))]
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
    home = Path(os.environ.get("HORIZON_RAY_HOME") or "~/.cache/horizon-ray").expanduser()
    return home / "service"


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
