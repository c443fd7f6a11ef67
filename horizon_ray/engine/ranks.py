"""Several ranks of one job on one node, over one host copy of the model.

N processes (one per GPU; gloo ranks on the CPU for tests) share one host store in shared memory. Each runs
its own micro-batches through the same units (data parallel), sums a unit's gradient over its micro-batches
as one process would, and then the ranks reduce-scatter it: rank r receives the sum over every rank of the
r-th contiguous 1/N of the unit and copies only that to the host. The squared norms of the shards add up to
the global norm (an all-reduce of one scalar), the clip coefficient is the same on every rank, and each rank
updates its 1/N of the unit's master, moments and wire with exact AdamW (elementwise, so the shards are
independent). A step of N ranks with A micro-batches each is the step of one process with N x A micro-
batches, to roundoff.

A unit's wire is whole only once every rank has updated its shard: the ``updates`` fence is a table in
shared memory with one counter per rank and unit (each written by its rank alone), and a reader waits for
the smallest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from horizon_ray.engine.fence import Fence


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's ranks; ``Ranks()`` is a job of one."""

    rank: int = 0
    world: int = 1

    @property
    def many(self) -> bool:
        return self.world > 1

    def shard_size(self, n: int) -> int:
        return math.ceil(n / self.world)

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of n elements (the last rank's may be shorter, or empty)."""
        s = self.shard_size(n)
        return slice(min(n, self.rank * s), min(n, (self.rank + 1) * s))

    def padded(self, n: int) -> int:
        """n rounded up to a multiple of the world: what a reduce-scatter of n elements takes."""
        return self.shard_size(n) * self.world

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of this rank's shard of ``flat`` (whose length is padded())."""
        out = torch.empty(flat.numel() // self.world, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.many:
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.many:
            dist.barrier()

    def all_reduce_int(self, value: int, device: torch.device) -> int:
        if not self.many:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        return int(t.item())


class SharedFence(Fence):
    """The ``updates`` fence of several ranks: a [world, units] table of versions in shared memory. mark()
    bumps this rank's cell; wait() waits until every rank's cell of the unit has reached the version (the
    other ranks' shards of the unit are written when theirs are)."""

    POLL_S = 2e-4

    def __init__(self, table: torch.Tensor, rank: int, name: str):
        super().__init__(table.shape[1], name)
        self.table = table  # int64 [world, units], shared memory
        self.rank = rank

    def version(self, u: int) -> int:
        return int(self.table[:, u].min())

    def mark(self, u: int, payload=None) -> None:
        self.table[self.rank, u] += 1
        super().mark(u, payload)

    def wait(self, u: int, version: int):
        if int(self.table[:, u].min()) >= version:
            return None
        t0 = time.perf_counter()
        while int(self.table[:, u].min()) < version:
            if self._error is not None:
                raise self._error
            time.sleep(self.POLL_S)
        self.waited_s += time.perf_counter() - t0
        return None

    def reset(self, versions: list[int]) -> None:
        super().reset(versions)
        self.table[self.rank] = torch.tensor(versions, dtype=torch.int64)
