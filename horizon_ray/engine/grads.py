"""The gradient side of a step: accumulators on the device, the copies to the host, the global norm.

Each trained unit's gradient is summed over the micro-batches into an fp32 accumulator (the projections'
backward adds into it directly, kernels.py), counted into the squared global norm, and leaves once a step
for the unit's host gradient buffer. Then the ``grads`` fence is marked for the unit, with the event that
says the copy landed and the partial norm so far (what the speculative update reads).

On CUDA (``DeviceGrads``) the copies run on their own stream: layers cast to the compute dtype through two
layer-sized staging buffers (so a layer's accumulator is free for the next layer at once), the embedding and
head through the same staging piece by piece. LoRA's adapter gradients accumulate in one of two pooled fp32
buffers of the largest adapter's size, so device memory does not grow with the layer count.
On the CPU (``HostGrads``) an fp32 host gradient buffer is its own accumulator.

With several ranks (ranks.py) a unit's accumulator is reduce-scattered before it leaves: this rank copies
only its shard of the summed gradient to the host, counts only it in the norm, and the norm is all-reduced.
"""

from __future__ import annotations

import torch

from horizon_ray.engine.fence import Fence
from horizon_ray.engine.pinned import HostBuffers
from horizon_ray.engine.ranks import Ranks
from horizon_ray.engine.store import HostStore
from horizon_ray.engine.units import Units


class HostGrads:
    def __init__(self, store: HostStore, units: Units, grads: Fence, device: torch.device, ranks: Ranks):
        self.store = store
        self.units = units
        self.grads = grads  # marked when a trained unit's gradient of the step is on the host
        self.ranks = ranks
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=device)  # squared grad norm of the step
        self._adapter_acc: dict[int, torch.Tensor] = {}  # several ranks: adapter -> its private accumulator

    def accumulator(self, u: int, k: int) -> torch.Tensor:
        """A zeroed fp32 flat buffer for unit u's gradient of step k (several ranks: padded for the
        reduce-scatter; the layout's views take its first elements)."""
        unit = self.store.units[u]
        if not self.ranks.many and unit.grad_own is not None and unit.grad_own.dtype == torch.float32:
            return unit.grad_own.zero_()
        # the gradient lands in the wire the step is still reading, is narrower, or is the shared store's,
        # which every rank writes its shard of: accumulate apart
        return torch.zeros(self.ranks.padded(unit.layout.numel))

    def flush(self, u: int, acc: torch.Tensor, k: int) -> None:
        """Unit u's gradient is complete in acc: count it in the norm and send it (this rank's shard) to the
        host."""
        self._send(self.store.units[u], acc, k)
        self.grads.mark(u, (None, self.norm_sq.clone()))

    def _send(self, unit, acc: torch.Tensor, k: int) -> None:
        g = unit.grad_of(k)
        if self.ranks.many:
            shard, part = self.ranks.reduce_scatter(acc), self.ranks.shard(unit.layout.numel)
            self.norm_sq += torch.linalg.vector_norm(shard).square()
            g[part].copy_(shard[: part.stop - part.start])
            return
        self.norm_sq += torch.linalg.vector_norm(acc).square()
        if acc.data_ptr() != g.data_ptr():
            g.copy_(acc)

    def adapter_grads(self, a: int, k: int) -> dict[str, torch.Tensor]:
        """Zeroed fp32 views for adapter a's gradient (LoRA)."""
        adapter = self.store.adapters[a]
        if self.ranks.many:
            acc = self._adapter_acc[a] = torch.zeros(self.ranks.padded(adapter.layout.numel))
            return adapter.layout.views(acc)
        return adapter.layout.views(adapter.grad_of(k).zero_())

    def flush_adapter(self, a: int, k: int) -> None:
        adapter = self.store.adapters[a]
        if self.ranks.many:
            self._send(adapter, self._adapter_acc.pop(a), k)
        else:
            self.norm_sq += torch.linalg.vector_norm(adapter.grad_of(k)).square()
        self.grads.mark(a, (None, self.norm_sq.clone()))

    def finish(self) -> float:
        """Every gradient of the step is on the host: the global gradient norm (the step's one host sync)."""
        norm = float(self.ranks.all_reduce(self.norm_sq).sqrt())
        self.norm_sq.zero_()
        return norm

    def reset(self) -> None:
        self.norm_sq.zero_()

    def device_bytes(self) -> dict[str, int]:
        return {}


class DeviceGrads(HostGrads):
    def __init__(self, store: HostStore, units: Units, grads: Fence, device: torch.device, ranks: Ranks,
                 buffers: HostBuffers, d2h: torch.cuda.Stream):
        super().__init__(store, units, grads, device, ranks)
        self.compute = torch.cuda.current_stream(device)
        self.d2h = d2h
        # several ranks: the reduce-scattered shard a D2H copy reads, by the buffer it came from, held until
        # compute has waited for that copy (freed at once, compute could reuse its memory before the copy read it)
        self._shards: dict = {}
        self._acc: dict = {}
        self._stage = None
        # the partial norm after each trained unit, copied to the host behind its gradient
        self._partial = buffers.get("partial_norms", (len(store.trained),), torch.float32)
        if store.frozen:
            max_adapter = ranks.padded(max((a.layout.numel for a in store.adapters), default=1))
            self._adapter_pool = [torch.empty(max_adapter, device=device) for _ in range(2)]
            self._adapter_free: list = [None, None]  # event: the pool buffer's D2H finished
            self._adapter_held: dict[int, int] = {}  # adapter -> pool buffer its gradient accumulates in
            self._adapter_next = 0
            return
        units_ = store.units
        dtype = store.compute_dtype
        max_layer = max((u.layout.numel for u in units_[1:-1]), default=1)
        big = max(units_[0].layout.numel, units_[-1].layout.numel)
        pad = ranks.padded  # several ranks reduce-scatter whole accumulators
        # with a narrower compute dtype a layer's gradient is cast into a staging buffer right away, which
        # frees its accumulator for the next layer at once: one suffices. In fp32 two alternate.
        staged = dtype != torch.float32
        layer_acc = torch.empty(pad(max_layer), device=device)
        self._acc = {0: layer_acc, 1: layer_acc if staged else torch.empty(pad(max_layer), device=device)}
        tied = all(t.key != "lm_head" for t in units_[-1].layout.tensors)
        if tied:
            self._acc["embed"] = torch.empty(pad(units_[0].layout.numel), device=device)
            self._acc["head"] = torch.empty(pad(units_[-1].layout.numel), device=device)
        else:  # untied embedding and head share one: their gradients are never live together
            self._acc["embed"] = self._acc["head"] = torch.empty(pad(big), device=device)
        # buffer -> event: its D2H finished
        self._acc_free: dict[int, torch.cuda.Event | None] = {id(b): None for b in self._acc.values()}
        if staged:  # a layer's gradient is cast before it leaves; two casts in flight
            self._stage = [torch.empty(max_layer, dtype=dtype, device=device) for _ in range(2)]
            self._stage_free: list[torch.cuda.Event | None] = [None, None]
            self._stage_next = 0

    def _acc_key(self, u: int):
        return "embed" if u == self.units.embed else "head" if u == self.units.head else (u - 1) % 2

    def accumulator(self, u: int, k: int) -> torch.Tensor:
        buf = self._acc[self._acc_key(u)]
        free = self._acc_free[id(buf)]
        if free is not None:
            # the buffer's previous gradient must have left for the host before it is overwritten
            self.compute.wait_event(free)
            self._shards.pop(id(buf), None)
        return buf[:self.ranks.padded(self.store.units[u].layout.numel)].zero_()

    def flush(self, u: int, acc: torch.Tensor, k: int) -> None:
        unit = self.store.units[u]
        host = unit.grad_of(k)
        if self.ranks.many:  # the sum over the ranks of this rank's shard; only it leaves
            part = self.ranks.shard(unit.layout.numel)
            acc, host = self.ranks.reduce_scatter(acc)[: part.stop - part.start], host[part]
        else:
            acc = acc[:unit.layout.numel]
        self.norm_sq += torch.linalg.vector_norm(acc).square()
        if self._stage is None:
            buf = self._acc[self._acc_key(u)]
            self._acc_free[id(buf)] = self._d2h(host, acc)
            if self.ranks.many:
                self._shards[id(buf)] = acc
        else:
            # narrowed piece by piece through the two layer-sized staging buffers, so that the vocab-sized
            # units need no cast buffer of their own; the casts run on the compute stream, so the
            # accumulator is free for the next unit already
            size = self._stage[0].numel()
            for lo in range(0, acc.numel(), size):
                hi = min(lo + size, acc.numel())
                i = self._stage_next
                self._stage_next ^= 1
                free = self._stage_free[i]
                if free is not None:
                    self.compute.wait_event(free)  # staging buffer drained by its last D2H
                piece = self._stage[i][: hi - lo]
                piece.copy_(acc[lo:hi])
                self._stage_free[i] = self._d2h(host[lo:hi], piece)
        self._mark(u)

    def adapter_grads(self, a: int, k: int) -> dict[str, torch.Tensor]:
        i = self._adapter_next
        self._adapter_next ^= 1
        if self._adapter_free[i] is not None:
            # the pool buffer's previous gradient must have left for the host before it is overwritten
            self.compute.wait_event(self._adapter_free[i])
            self._shards.pop(("adapter", i), None)
        self._adapter_held[a] = i
        adapter = self.store.adapters[a]
        return adapter.layout.views(self._adapter_pool[i][:self.ranks.padded(adapter.layout.numel)].zero_())

    def flush_adapter(self, a: int, k: int) -> None:
        adapter = self.store.adapters[a]
        i = self._adapter_held.pop(a)
        n = adapter.layout.numel
        grad, host = self._adapter_pool[i][:self.ranks.padded(n)], adapter.grad_of(k)
        if self.ranks.many:
            part = self.ranks.shard(n)
            grad, host = self.ranks.reduce_scatter(grad)[: part.stop - part.start], host[part]
        else:
            grad = grad[:n]
        self.norm_sq += torch.linalg.vector_norm(grad).square()
        self._adapter_free[i] = self._d2h(host, grad)
        if self.ranks.many:
            self._shards[("adapter", i)] = grad
        self._mark(a)

    def _mark(self, t: int) -> None:
        """Trained unit t's gradient is queued for the host: send the partial norm behind it, mark the fence."""
        ev = self._d2h(self._partial[t], self.norm_sq)
        self.grads.mark(t, (ev, self._partial[t]))

    def _d2h(self, host: torch.Tensor, dev: torch.Tensor) -> torch.cuda.Event:
        produced = torch.cuda.Event()
        produced.record(self.compute)
        with torch.cuda.stream(self.d2h):
            # the gradient is final only once the compute stream has finished writing it
            self.d2h.wait_event(produced)
            host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h)
        return done

    def finish(self) -> float:
        norm = float(self.ranks.all_reduce(self.norm_sq).sqrt())
        self.d2h.synchronize()
        self._shards.clear()
        self.norm_sq.zero_()
        return norm

    def reset(self) -> None:
        torch.cuda.synchronize(self.norm_sq.device)
        self._shards.clear()
        self.norm_sq.zero_()

    def device_bytes(self) -> dict[str, int]:
        out = {"grad_accumulators": sum({id(b): b.nbytes for b in self._acc.values()}.values())}
        if self._stage is not None:
            out["grad_staging"] = sum(b.nbytes for b in self._stage)
        if self.store.frozen:
            out["adapter_grads"] = sum(b.nbytes for b in self._adapter_pool)
        return out
