"""Placement: the planner's verdict for a job on each node, and best-fit on free host RAM.

A planner is a function `(spec dict, NodeInfo) -> plan dict` with at least `host_bytes`, `gpu_bytes`,
`fits` and `reason` (the planner helper's `horizon_ray.planner.plan_for_spec`, adapted by
`default_planner`). Best fit: among alive nodes whose free RAM holds the job now, the one left with the
least free RAM, so large nodes stay free for large jobs.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from horizon_ray.cluster.messages import NodeInfo
from horizon_ray.cluster.tenants import format_bytes

Planner = Callable[[dict[str, Any], NodeInfo], dict[str, Any]]


def default_planner(spec: dict[str, Any], node: NodeInfo) -> dict[str, Any]:
    """The planner helper's `plan_for_spec` for a node described by `node`, as a plain dict."""
    from horizon_ray import planner

    node_spec = planner.NodeSpec(**_node_spec_kwargs(planner.NodeSpec, node))
    return plan_to_dict(planner.plan_for_spec(spec, node_spec))


def _node_spec_kwargs(node_spec_cls: type, node: NodeInfo) -> dict[str, Any]:
    if not dataclasses.is_dataclass(node_spec_cls):
        return {}
    names = {f.name for f in dataclasses.fields(node_spec_cls)}
    candidates = {
        "name": node.node_id,
        "node_id": node.node_id,
        "ram_bytes": node.ram_bytes,
        "host_bytes": node.ram_bytes,
        "host_ram_bytes": node.ram_bytes,
        "gpu_count": node.gpu_count,
        "num_gpus": node.gpu_count,
        "gpus": node.gpu_count,
        "gpu_bytes": node.gpu_memory_bytes if node.gpu_count else 0,
        "gpu_memory_bytes": node.gpu_memory_bytes if node.gpu_count else 0,
        "gpu_mem_bytes": node.gpu_memory_bytes if node.gpu_count else 0,
    }
    return {k: v for k, v in candidates.items() if k in names}


def plan_to_dict(plan: Any) -> dict[str, Any]:
    """A planner result (dataclass, object with to_dict, or dict) as JSON-ready plain data."""
    if isinstance(plan, dict):
        d = dict(plan)
    elif hasattr(plan, "to_dict"):
        d = plan.to_dict()
    elif dataclasses.is_dataclass(plan):
        d = dataclasses.asdict(plan)
    else:
        raise TypeError(f"planner returned {type(plan).__name__}; expected a dict or a dataclass")
    return _plain(d)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass
class Candidate:
    """The verdict for one job on one node."""

    node_id: str  # the node
    ram_bytes: int  # its host RAM
    free_bytes: int  # its free host RAM now
    fits: bool  # it can hold the job when empty
    fits_now: bool  # it can hold the job now
    host_bytes: int  # host RAM the job needs there
    gpu_bytes: int  # GPU memory the job needs there
    reason: str  # why it fits or not
    plan: dict[str, Any]  # the planner's full output for that node

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("plan")
        return d


def evaluate(spec: dict[str, Any], nodes: Iterable[NodeInfo], planner: Planner,
             cache: dict | None = None, cache_key: str | None = None) -> list[Candidate]:
    """The planner's verdict on every alive node, using each node's free RAM and GPUs now."""
    out = []
    for node in nodes:
        if not node.alive:
            continue
        key = (cache_key, node.node_id, node.ram_bytes, node.gpu_count, node.gpu_memory_bytes)
        if cache is not None and cache_key is not None and key in cache:
            plan = cache[key]
        else:
            plan = plan_to_dict(planner(spec, node))
            if cache is not None and cache_key is not None:
                cache[key] = plan
        out.append(_candidate(node, plan))
    return out


def _candidate(node: NodeInfo, plan: dict[str, Any]) -> Candidate:
    host = int(plan.get("host_bytes") or 0)
    gpu = int(plan.get("gpu_bytes") or 0) if node.gpu_count else 0
    planner_fits = bool(plan.get("fits", True))
    gpu_jobs = sum(1 for r in node.ledger if r.gpu_bytes)
    if not planner_fits:
        fits, reason = False, str(plan.get("reason") or "the planner says it does not fit")
    elif host > node.ram_bytes:
        fits, reason = False, (f"needs {format_bytes(host)} host RAM; node {node.node_id} has "
                               f"{format_bytes(node.ram_bytes)}")
    elif gpu and gpu > node.gpu_memory_bytes:
        fits, reason = False, (f"needs {format_bytes(gpu)} GPU memory; node {node.node_id}'s GPUs have "
                               f"{format_bytes(node.gpu_memory_bytes)}")
    else:
        fits, reason = True, str(plan.get("reason") or "fits")
    fits_now = fits and host <= node.free_bytes and (not gpu or gpu_jobs < node.gpu_count)
    if fits and not fits_now:
        reason = (f"needs {format_bytes(host)} host RAM; node {node.node_id} has "
                  f"{format_bytes(node.free_bytes)} free of {format_bytes(node.ram_bytes)}")
        if gpu and gpu_jobs >= node.gpu_count:
            reason = f"needs a GPU; all {node.gpu_count} GPUs of node {node.node_id} are taken"
    return Candidate(node_id=node.node_id, ram_bytes=node.ram_bytes, free_bytes=node.free_bytes, fits=fits,
                     fits_now=fits_now, host_bytes=host, gpu_bytes=gpu, reason=reason, plan=plan)


def best_fit(candidates: list[Candidate]) -> Candidate | None:
    """The candidate that fits now and leaves the least free RAM on its node (ties: node id)."""
    now = [c for c in candidates if c.fits_now]
    return min(now, key=lambda c: (c.free_bytes - c.host_bytes, c.node_id)) if now else None


def never_fits_reason(candidates: list[Candidate]) -> str:
    """One sentence on why no node can ever hold the job."""
    smallest = min((c.host_bytes for c in candidates), default=0)
    largest = max(candidates, key=lambda c: c.ram_bytes)
    per_node = "; ".join(f"{c.node_id}: {c.reason}" for c in candidates)
    return (f"no node can ever hold this job: it needs at least {format_bytes(smallest)} host RAM and the "
            f"largest node, {largest.node_id}, has {format_bytes(largest.ram_bytes)} ({per_node})")


def waiting_reason(candidates: list[Candidate]) -> str:
    """One sentence on why a job that some node can hold cannot start now."""
    fitting = [c for c in candidates if c.fits]
    host = min(c.host_bytes for c in fitting)
    most_free = max(fitting, key=lambda c: c.free_bytes)
    return (f"waiting for {format_bytes(host)} of free host RAM on a node that can hold it "
            f"(most free now: {most_free.node_id} with {format_bytes(most_free.free_bytes)})")
