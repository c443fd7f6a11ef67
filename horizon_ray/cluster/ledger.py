"""A node's reservation ledger: the RAM, GPUs and cores set aside for the jobs running on it (the agent's,
and the fake agent's, one source of truth for what a node can still take)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from horizon_ray.cluster import placement
from horizon_ray.cluster.agent_protocol import ReservationRefused
from horizon_ray.cluster.messages import NodeInfo, Reservation


@dataclass
class Ledger:
    """Memory, GPUs and cores of one node set aside for running jobs."""

    ram_bytes: int  # host RAM offered to jobs
    gpu_count: int = 0  # GPUs of the node; a GPU job holds resources.gpus of them alone
    gpu_memory_bytes: int = 0  # memory of one GPU
    entries: dict[str, Reservation] = field(default_factory=dict)  # job_id -> reservation
    cpu_count: int = 0  # cores split among the engines (0: no split, each engine keeps its default)

    @property
    def reserved_bytes(self) -> int:
        return sum(r.host_bytes for r in self.entries.values())

    @property
    def reserved_gpu_bytes(self) -> int:
        return sum(r.gpu_bytes for r in self.entries.values())

    @property
    def free_gpu_indices(self) -> list[int]:
        busy = {i for r in self.entries.values() for i in r.gpu_indices}
        return [i for i in range(self.gpu_count) if i not in busy]

    def cpu_share(self, gpu: bool) -> int:
        """Cores an engine starting now gets (0 when the node's cores are unknown).

        A GPU engine gets cores / GPUs: a fixed share per GPU, so the node's engines never oversubscribe
        its cores however many GPUs are busy, and a job's threads do not depend on the order jobs start.
        A CPU engine gets an equal share with the engines running now (itself included).
        """
        if not self.cpu_count:
            return 0
        if gpu:
            return max(1, self.cpu_count // max(1, self.gpu_count))
        return max(1, self.cpu_count // (len(self.entries) + 1))

    def reserve(self, job_id: str, host_bytes: int, gpu_bytes: int, needs_gpu: bool | None = None,
                tenant: str | None = None, gpus: int = 1, cpu_threads: int = 0) -> Reservation:
        """Set aside host RAM, `gpus` free GPUs (when `needs_gpu`; None: when gpu_bytes > 0 on a GPU node) and
        a share of the cores per GPU for `tenant`'s job (`cpu_threads` when given: the job's pinned count);
        raise ReservationRefused when the node cannot take it now."""
        if job_id in self.entries:
            return self.entries[job_id]
        gpu = bool(gpu_bytes) and self.gpu_count > 0 if needs_gpu is None else bool(needs_gpu)
        if self.reserved_bytes + host_bytes > self.ram_bytes:
            raise ReservationRefused(
                f"job {job_id} needs {host_bytes} host bytes; {self.ram_bytes - self.reserved_bytes} free")
        indices: list[int] = []
        if gpu:
            free = self.free_gpu_indices
            if len(free) < gpus:
                want = "a GPU" if gpus == 1 else f"{gpus} GPUs"
                raise ReservationRefused(f"job {job_id} needs {want}; " + (
                    placement.gpus_free(self.gpu_count, len(free), gpus) if self.gpu_count else "the node has none"))
            indices = free[:gpus]
        threads = cpu_threads or self.cpu_share(gpu) * (len(indices) or 1)
        self.entries[job_id] = Reservation(job_id, int(host_bytes), int(gpu_bytes), time.time(),
                                           gpu_indices=indices, cpu_threads=threads, tenant=tenant)
        return self.entries[job_id]

    def release(self, job_id: str) -> None:
        self.entries.pop(job_id, None)

    def node_info(self, node_id: str, **extra: Any) -> NodeInfo:
        return NodeInfo(
            node_id=node_id,
            ram_bytes=self.ram_bytes,
            gpu_count=self.gpu_count,
            gpu_memory_bytes=self.gpu_memory_bytes,
            reserved_bytes=self.reserved_bytes,
            reserved_gpu_bytes=self.reserved_gpu_bytes,
            ledger=list(self.entries.values()),
            cpu_count=self.cpu_count,
            **extra,
        )
