"""Placement: the planner's verdict for a job on each node, and best-fit on free host RAM and GPUs.

A planner is a function `(spec dict, NodeInfo) -> plan dict` with at least `host_bytes`, `gpu_bytes`,
`fits` and `reason` (the planner helper's `horizon_ray.planner.plan_for_spec`, adapted by
`default_planner`). Best fit: among alive nodes that hold the job now, the one left with the least free
RAM, so large nodes stay free for large jobs.

GPUs and RAM are placed together. A node runs one engine per GPU, each on its own GPU, all drawing on the
node's one RAM ledger. Whether a job needs a GPU (`needs_gpu`) follows its `engine.device`:
- "cpu": never; it may run on any node, next to GPU jobs, and takes no GPU;
- "cuda" (or "cuda:N": the agent picks the GPU, the index is ignored): always; a node without GPUs can never
  hold it;
- "auto" (the default): a GPU on a node that has GPUs, the CPU on a node that has none. On a GPU node whose
  GPUs are all busy it waits for one (it does not fall back to the CPU there). With `resources.gpus` above 1 it
  asks for that many GPUs, and no node without GPUs holds it (CPU ranks are asked for with "cpu").
A GPU job takes `resources.gpus` GPUs of one node (default 1; one rank on each, over one host copy of the
model): a node with fewer GPUs can never hold it. It fits a node now when the node's free RAM holds it *and*
that many of its GPUs are free; otherwise it waits in the queue with the reason (e.g. "node b: all 2 GPUs
busy", "node b: 1 of 4 GPUs free, the job needs 2").
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from horizon_ray.cluster.errors import InvalidSpec
from horizon_ray.cluster.messages import NodeInfo
from horizon_ray.cluster.tenants import format_bytes
from horizon_ray.errors import BadInput
from horizon_ray.jobspec import EngineSpec, ResourcesSpec, parse
from horizon_ray.workload import resolve

Planner = Callable[[dict[str, Any], NodeInfo], dict[str, Any]]
S = TypeVar("S", bound=BaseModel)


def needs_gpu(spec: dict[str, Any], gpu_count: int) -> bool:
    """Whether `spec`'s engine takes a GPU of a node that has `gpu_count` GPUs: its engine.device resolved
    for the node by the rule the job runner follows (``workload.resolve``)."""
    device = spec_section(spec, "engine", EngineSpec).device
    if device == "auto" and gpus_wanted(spec) > 1:
        return True  # several GPUs asked for: CPU ranks would not be what the user wanted
    return resolve(gpu=gpu_count > 0, device=device).cuda


def gpus_wanted(spec: dict[str, Any]) -> int:
    """The GPUs a GPU job holds: its resources.gpus."""
    return spec_section(spec, "resources", ResourcesSpec).gpus


def spec_section(spec: dict[str, Any], name: str, section: type[S]) -> S:
    """One section of `spec` as the typed spec reads it: its defaults where the section or a key is absent,
    BadInput naming the key for a value the spec refuses (never a default of the cluster's own)."""
    return parse(section, spec.get(name) or {}, prefix=f"{name}.")


def default_planner(spec: dict[str, Any], node: NodeInfo) -> dict[str, Any]:
    """The planner helper's `plan_for_spec` for a node described by `node`, as a plain dict.

    A GPU job's step time is planned for the node full: one engine on each of its GPUs, sharing the host's
    DRAM bandwidth and cores (`concurrent_engines` = the node's GPUs), the speed it will see at the busiest.
    """
    from horizon_ray import planner

    node_spec = planner.NodeSpec.from_node_info(node)
    engines = node.gpu_count if node.gpu_count and needs_gpu(spec, node.gpu_count) else 1
    return plan_to_dict(planner.plan_for_spec(spec, node_spec, concurrent_engines=engines))


def plan_to_dict(plan: Any) -> dict[str, Any]:
    """A planner result (dataclass, object with to_dict, or dict) as JSON-ready plain data."""
    if isinstance(plan, dict):
        d = dict(plan)
    elif hasattr(plan, "to_dict"):
        d = plan.to_dict()
    elif dataclasses.is_dataclass(plan) and not isinstance(plan, type):
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
    fits_now: bool  # it can hold the job now (free RAM, and a free GPU when it needs one)
    host_bytes: int  # host RAM the job needs there
    gpu_bytes: int  # GPU memory the job needs there
    reason: str  # why it fits or not
    plan: dict[str, Any]  # the planner's full output for that node
    short_of: list[str] = dataclasses.field(default_factory=list)  # what the node lacks: "host RAM", "GPU memory",
    # "a GPU" (the binding limits); [] when it fits
    needs_gpu: bool = False  # the job takes `gpus` of the node's GPUs there (see needs_gpu)
    gpus: int = 1  # GPUs it takes when it needs any (resources.gpus)
    gpu_count: int = 0  # GPUs of the node
    free_gpus: int = 0  # GPUs of the node no job holds now

    @property
    def gpus_taken(self) -> int:
        """GPUs it takes on the node (0 for a CPU job)."""
        return self.gpus if self.needs_gpu else 0

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("plan")
        return d


def evaluate(spec: dict[str, Any], nodes: Iterable[NodeInfo], planner: Planner,
             cache: dict | None = None, cache_key: str | None = None) -> list[Candidate]:
    """The planner's verdict on every alive node, using each node's free RAM and GPUs now. InvalidSpec
    when the planner cannot plan the spec at all (it names the problem)."""
    out = []
    for node in nodes:
        if not node.alive:
            continue
        probed = (node.ceilings or {}).get("source")  # a plan made before the node's probe is planned again
        key = (cache_key, node.node_id, node.ram_bytes, node.gpu_count, node.gpu_memory_bytes, probed)
        if cache is not None and cache_key is not None and key in cache:
            plan = cache[key]
        else:
            try:
                plan = plan_to_dict(planner(spec, node))
            except BadInput as exc:  # the planner names what it cannot plan (model path, lora names, ...)
                raise InvalidSpec(f"cannot plan the job: {exc}", **({"field": exc.field} if exc.field else {})
                                  ) from None
            if cache is not None and cache_key is not None:
                cache[key] = plan
        out.append(_candidate(node, plan, needs_gpu(spec, node.gpu_count), gpus_wanted(spec)))
    return out


def _candidate(node: NodeInfo, plan: dict[str, Any], gpu_job: bool, gpus: int = 1) -> Candidate:
    host = int(plan.get("host_bytes") or 0)
    gpu = int(plan.get("gpu_bytes") or 0) if gpu_job else 0
    planner_fits = bool(plan.get("fits", True))
    free_gpus = node.free_gpus
    short: list[str] = []
    if not planner_fits:
        fits, reason = False, str(plan.get("reason") or "the planner says it does not fit")
        short = [str(x) for x in plan.get("short_of") or []]
    elif gpu_job and not node.gpu_count and gpus > 1:
        fits, reason = False, (f"resources.gpus {gpus} needs {gpus} GPUs of one node; node {node.node_id} has none "
                               f"(engine.device cpu runs {gpus} CPU ranks)")
        short = ["GPUs"]
    elif gpu_job and not node.gpu_count:
        fits, reason = False, (f"engine.device cuda needs a GPU; node {node.node_id} has none (set "
                               "engine.device to auto or cpu to run on the CPU)")
        short = ["a GPU"]
    elif gpu_job and node.gpu_count < gpus:
        fits, reason = False, (f"resources.gpus {gpus} needs {gpus} GPUs of one node; node {node.node_id} has "
                               f"{node.gpu_count} (ask for at most the GPUs of the largest node)")
        short = ["GPUs"]
    elif host > node.ram_bytes:
        fits, reason = False, (f"needs {format_bytes(host)} host RAM; node {node.node_id} has "
                               f"{format_bytes(node.ram_bytes)}")
        short = ["host RAM"]
    elif gpu and gpu > node.gpu_memory_bytes:
        fits, reason = False, (f"needs {format_bytes(gpu)} GPU memory; node {node.node_id}'s GPUs have "
                               f"{format_bytes(node.gpu_memory_bytes)}")
        short = ["GPU memory"]
    else:
        fits, reason = True, str(plan.get("reason") or "fits")
    ram_now = host <= node.free_bytes
    gpu_now = not gpu_job or free_gpus >= gpus
    fits_now = fits and ram_now and gpu_now
    if fits and not fits_now:
        reason = _busy(node, host, ram_now, gpu_now, gpus)
    return Candidate(node_id=node.node_id, ram_bytes=node.ram_bytes, free_bytes=node.free_bytes, fits=fits,
                     fits_now=fits_now, host_bytes=host, gpu_bytes=gpu, reason=reason, plan=plan, short_of=short,
                     needs_gpu=gpu_job, gpus=gpus, gpu_count=node.gpu_count, free_gpus=free_gpus)


def _busy(node: NodeInfo, host: int, ram_now: bool, gpu_now: bool, gpus: int = 1) -> str:
    """Why a node that can hold a job cannot take it now."""
    ram = (f"needs {format_bytes(host)} host RAM; node {node.node_id} has {format_bytes(node.free_bytes)} free "
           f"of {format_bytes(node.ram_bytes)}")
    if gpu_now:
        return ram
    busy = f"node {node.node_id}: {gpus_free(node.gpu_count, node.free_gpus, gpus)}"
    return busy if ram_now else f"{busy}; it {ram}"


def gpus_busy(n: int) -> str:
    """ "all 2 GPUs busy" (or "its 1 GPU busy")."""
    return f"all {n} GPUs busy" if n != 1 else "its 1 GPU busy"


def gpus_free(n: int, free: int, wanted: int = 1) -> str:
    """Why `wanted` GPUs are not free now: "all 2 GPUs busy", or "1 of 4 GPUs free, the job needs 2"."""
    return gpus_busy(n) if free == 0 else f"{free} of {n} GPUs free, the job needs {wanted}"


def best_fit(candidates: list[Candidate]) -> Candidate | None:
    """The candidate that fits now and leaves the least free RAM on its node (ties: node id)."""
    now = [c for c in candidates if c.fits_now]
    return min(now, key=lambda c: (c.free_bytes - c.host_bytes, c.node_id)) if now else None


def never_fits_reason(candidates: list[Candidate]) -> str:
    """One sentence on why no node can ever hold the job, naming the limit that binds (host RAM, GPU memory, a
    GPU). Each node's own reason is its candidate's (`per_node_reasons`)."""
    head = "no node can ever hold this job"
    if candidates and all(c.needs_gpu and not c.gpu_count for c in candidates) and candidates[0].gpus > 1:
        return (f"{head}: resources.gpus {candidates[0].gpus} needs {candidates[0].gpus} GPUs of one node and no "
                f"node has a GPU; set engine.device cpu to train on {candidates[0].gpus} CPU ranks, or add a GPU node")
    if candidates and all(c.needs_gpu and not c.gpu_count for c in candidates):
        return (f"{head}: its engine.device cuda needs a GPU and no node has one; set engine.device to auto or "
                "cpu to train on the CPU, or add a GPU node")
    if candidates and all(c.short_of == ["GPUs"] for c in candidates):
        most = max(candidates, key=lambda c: (c.gpu_count, c.node_id))
        return (f"{head}: resources.gpus {most.gpus} needs {most.gpus} GPUs of one node and the most any node has "
                f"is {most.gpu_count} (node {most.node_id}); ask for at most {most.gpu_count}")
    if candidates and all(c.short_of == ["GPU memory"] for c in candidates):
        need = min(int(c.plan.get("gpu_bytes") or c.gpu_bytes) for c in candidates)
        roomiest = max(candidates, key=lambda c: int(c.plan.get("gpu_limit_bytes") or 0))
        return (f"{head}: GPU memory is the limit: it needs at least {format_bytes(need)} of GPU memory and the "
                f"most any node offers it is {format_bytes(int(roomiest.plan.get('gpu_limit_bytes') or 0))} (node "
                f"{roomiest.node_id}); host RAM would suffice. Fewer tokens at once through a layer "
                "(training.micro_batch_size) or a larger GPU budget fixes it")
    smallest = min((c.host_bytes for c in candidates), default=0)
    largest = max(candidates, key=lambda c: c.ram_bytes)
    if all("host RAM" in c.short_of or not c.short_of for c in candidates):
        return (f"{head}: host RAM is the limit: it needs at least {format_bytes(smallest)} of host RAM and the "
                f"largest node, {largest.node_id}, has {format_bytes(largest.ram_bytes)}")
    lacks = " or ".join(sorted({x for c in candidates for x in c.short_of}))
    return f"{head}: every node lacks {lacks} for it (see each node's reason)"


def per_node_reasons(candidates: list[Candidate]) -> list[str]:
    """Each node's verdict, one line each ("node a: ..."), for a person reading why a job waits or is
    refused."""
    return [f"node {c.node_id}: {c.reason}" for c in sorted(candidates, key=lambda c: c.node_id)]


def waiting_reason(candidates: list[Candidate]) -> str:
    """One sentence on why a job that some node can hold cannot start now."""
    fitting = [c for c in candidates if c.fits]
    host = min(c.host_bytes for c in fitting)
    if not any(c.needs_gpu for c in fitting):
        most_free = max(fitting, key=lambda c: c.free_bytes)
        return (f"waiting for {format_bytes(host)} of free host RAM on a node that can hold it "
                f"(most free now: {most_free.node_id} with {format_bytes(most_free.free_bytes)})")
    per_node = []
    for c in sorted(fitting, key=lambda c: c.node_id):
        why = [gpus_free(c.gpu_count, c.free_gpus, c.gpus)] if c.needs_gpu and c.free_gpus < c.gpus else []
        if c.host_bytes > c.free_bytes:
            why.append(f"{format_bytes(c.free_bytes)} free host RAM")
        per_node.append(f"node {c.node_id}: {', '.join(why)}" if why else c.reason)  # held for an earlier job
    ram_short = any(c.host_bytes > c.free_bytes for c in fitting)
    n = max(c.gpus for c in fitting)
    gpu = "a free GPU" if n == 1 else f"{n} free GPUs of one node"
    what = f"{gpu} and {format_bytes(host)} of free host RAM on one node" if ram_short else gpu
    return f"waiting for {what} ({'; '.join(per_node)})"
