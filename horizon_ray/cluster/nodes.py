"""Simulated nodes as `horizon-ray serve --simulate-nodes` declares them (no Ray here: the agents, the fake
cluster and the local cluster read the same declaration).

A simulated node is declared as `NAME=RAM[:Ngpu[@GPU_MEMORY]][:Ncpu]`:
- `a=16GiB`: 16 GiB of RAM, no GPU;
- `b=512GiB:4gpu`: and 4 logical GPUs of the planner's default memory (one H200, 143771 MiB);
- `c=1TiB:8gpu@80GiB:64cpu`: 8 logical GPUs of 80 GiB, and 64 cores for the agent to split among its
  engines (default: the cores of this machine).
Logical GPUs are declared to Ray (`num_gpus`) and to the node's agent, which hands them out one per job
(CUDA_VISIBLE_DEVICES=0, 1, ...) exactly as it would real ones; nothing on this machine needs a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from horizon_ray.cluster.tenants import parse_bytes
from horizon_ray.errors import BadInput
from horizon_ray.planner.node import H200_NODE

_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
_GPUS = re.compile(r"^([0-9]+)gpus?(?:@(.+))?$", re.IGNORECASE)
_CPUS = re.compile(r"^([0-9]+)cpus?$", re.IGNORECASE)
_SYNTAX = "NAME=RAM[:Ngpu[@GPU_MEMORY]][:Ncpu], e.g. a=16GiB,b=512GiB:4gpu,c=1TiB:8gpu@80GiB:64cpu"
DEFAULT_GPU_MEMORY_BYTES = H200_NODE.gpu_mem_bytes  # the planner's default node: one H200 as nvidia-smi reports it


@dataclass(frozen=True)
class SimulatedNode:
    """What a simulated node declares to the planner and to its agent."""

    ram_bytes: int  # host RAM offered to jobs
    gpu_count: int = 0  # logical GPUs, handed out one per job like real ones
    gpu_memory_bytes: int = 0  # memory of one logical GPU (0 without GPUs)
    cpu_count: int | None = None  # cores the agent splits among its engines; None: this machine's


def parse_node_value(name: str, value: int | str | SimulatedNode) -> SimulatedNode:
    """One node's declaration: bytes of RAM, or "RAM[:Ngpu[@GPU_MEMORY]][:Ncpu]". ValueError names the fix."""
    if isinstance(value, SimulatedNode):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        ram, parts = value, []
    else:
        ram_text, *parts = str(value).split(":")
        ram = parse_bytes(ram_text.strip(), what=f"the RAM of node {name}", unit_required=True)
    if ram <= 0:
        raise BadInput(f"node {name} has no RAM; give it a size like 16GiB")
    gpus, gpu_mem, cpus = 0, 0, None
    seen: set[str] = set()
    for part in (x.strip() for x in parts):
        g, c = _GPUS.match(part), _CPUS.match(part)
        if not (g or c):
            raise BadInput(f"node {name}: {part!r} is neither Ngpu[@GPU_MEMORY] nor Ncpu; write {_SYNTAX}")
        kind = "GPUs" if g else "cores"
        if kind in seen:
            raise BadInput(f"node {name} declares its {kind} twice in {value!r}; write {_SYNTAX}")
        seen.add(kind)
        if g:
            gpus = int(g.group(1))
            gpu_mem = parse_bytes(g.group(2), what=f"the GPU memory of node {name}", unit_required=True) if g.group(2) \
                else DEFAULT_GPU_MEMORY_BYTES
            if gpus < 1 or gpu_mem <= 0:
                raise BadInput(f"node {name}: {part!r} declares no GPU; write e.g. 2gpu or 2gpu@80GiB, or "
                               "leave the GPUs out for a node without")
        elif c is not None:
            cpus = int(c.group(1))
            if cpus < 1:
                raise BadInput(f"node {name}: {part!r} declares no core; write e.g. 16cpu")
    return SimulatedNode(ram_bytes=ram, gpu_count=gpus, gpu_memory_bytes=gpu_mem if gpus else 0, cpu_count=cpus)


def parse_simulated_cluster(text: str) -> dict[str, SimulatedNode]:
    """ "a=16GiB,b=512GiB:2gpu" -> {"a": SimulatedNode(16 GiB), "b": SimulatedNode(512 GiB, 2 GPUs of the
    default memory)}. Raises ValueError naming the fix."""
    nodes: dict[str, SimulatedNode] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not _NODE_NAME.match(name):
            raise BadInput(f"--simulate-nodes entry {item!r} is not {_SYNTAX.split(', e.g.')[0]}; write e.g. "
                           "a=16GiB,b=64GiB:2gpu (names: letters, digits, '_', '-')")
        if name in nodes:
            raise BadInput(f"--simulate-nodes names node {name!r} twice; give each node its own name")
        nodes[name] = parse_node_value(name, value.strip())
    if not nodes:
        raise BadInput("--simulate-nodes is empty; write e.g. a=16GiB,b=64GiB")
    return nodes


def parse_simulated_nodes(text: str) -> dict[str, int]:
    """ "a=16GiB,b=64GiB" -> {"a": 17179869184, "b": 68719476736}: the RAM of each node (the whole
    declaration, GPUs included: `parse_simulated_cluster`). Raises ValueError naming the fix."""
    return {name: node.ram_bytes for name, node in parse_simulated_cluster(text).items()}
