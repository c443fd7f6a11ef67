"""Moves units between the host store and the device: the only module that creates streams and events.

Weights: layer units live in a pool of 2 groups x K slots (K = checkpoint interval). Layer j sits in group
(j // K) % 2 at index j % K, so a whole block of K layers stays resident for its recompute and backward
while the next block streams into the other group: each layer crosses PCIe twice per step (forward,
backward), and the top two blocks are still resident when the backward starts, so they cross once.
Embedding and head have a slot each. A slot remembers which unit and which version of its weights it
holds, so a copy that would bring the same bytes again is skipped.

Gradients: each unit's gradient is summed over the micro-batches into an fp32 accumulator on the device,
then leaves once per step (layers cast to the compute dtype) on its own stream into the pinned host buffer.

Activation checkpoints: with offloading (the default on CUDA) each kept layer input goes to a pinned host
buffer during the forward and comes back one block ahead of the backward, so device memory does not grow
with the layer count or the checkpoint density.

LoRA (the store holds adapters): the base is frozen, so its units stream as above but never wait for the
optimizer, and no base gradient exists (no accumulators). The fp32 adapters are small (r x (in + out) per
target) and stay on the device for the whole run, each layer's in a resident buffer of its own: after the
host optimizer has written adapter j, its next use copies it once (H2D, versioned like a slot). Their
gradients accumulate in a resident fp32 buffer, zeroed per layer, and each layer's leaves once per step
(D2H) as soon as its backward is done; the gradient norm covers the adapters only.

On the CPU there are no streams: a slot is a view of the host wire buffer and copies are free.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from horizon_ray.engine.store import HostStore


class Streamer:
    def __init__(self, store: HostStore, device: torch.device, checkpoint_every: int, tied: bool,
                 wait_updated: Callable[[int], None], offload_checkpoints: bool = False):
        self.store = store
        self.device = device
        self.cuda = device.type == "cuda"
        self.K = checkpoint_every
        self.tied = tied
        # blocks until the optimizer has written trained unit u's new weights (with LoRA: adapter u)
        self.wait_updated = wait_updated
        units = store.units
        self.L = len(units) - 2
        self.lora = store.frozen
        self.version = [0] * len(units)  # bumped by the optimizer each time a unit's weights change
        self.adapter_version = [0] * len(store.adapters)  # the same for each layer's adapters
        self._adapter_held: dict[int, int] = {}  # adapter -> version on the device (CPU: last one waited for)
        # LoRA with the final norm trained: its adapter unit (after the layers'), read with the head's weights
        heads = [j for j, a in enumerate(store.adapters) if a.layout.name == "lora.head"]
        self.head_adapter: int | None = heads[0] if heads else None
        dtype = store.compute_dtype
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=device)  # sum of squared grads of the step
        # untied on CUDA: the embedding never needs the whole table on the device; its rows are gathered
        # on the host, and only [tokens x hidden] crosses
        self.host_embed = self.cuda and not tied
        self.offload = offload_checkpoints
        self._stashed: dict = {}  # checkpoint key -> tensors (device, or pinned host when offloading)
        self._returning: dict = {}  # checkpoint key -> (device tensors, event: their H2D copy landed)
        self._host_pool: dict = {}  # (checkpoint key, micro-batch) -> pinned host buffer, reused each step
        self._stash_events: list = []  # events: a checkpoint's copy to the host finished, oldest first
        self._sent: dict = {}  # checkpoint key -> event: its copy to the host finished (read by its return)

        if not self.cuda:
            self._slot_unit: dict[int, tuple[int, int]] = {}
            return

        self.compute = torch.cuda.current_stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        max_layer = max((u.layout.numel for u in units[1:-1]), default=1)
        n_slots = 2 * min(self.K, max(self.L, 1))
        # slot key -> flat device buffer. Layer slots are ints, the embedding and head slots are named.
        self._slots = {s: torch.empty(max_layer, dtype=dtype, device=device) for s in range(n_slots)}
        self._gathered: dict = {}  # micro-batch index -> (pinned rows buffer, event: its H2D finished)
        if not self.host_embed:
            self._slots["embed"] = torch.empty(units[0].layout.numel, dtype=dtype, device=device)
        self._slots["head"] = torch.empty(units[-1].layout.numel, dtype=dtype, device=device)
        self._slot_unit = {}  # slot -> (unit index, version) it holds or is receiving
        self._copied = {s: None for s in self._slots}  # slot -> event: its H2D copy finished
        self._read = {s: None for s in self._slots}  # slot -> event: its last reader finished
        self._acc: dict = {}
        self._acc_free: dict = {}
        self._stage = None
        if self.lora:
            self._init_adapters()
            return

        # fp32 gradient accumulators: two for layers (one filling while the other drains), and one per
        # end unit; untied embedding and head share one, as their gradients are never live together.
        big = max(units[0].layout.numel, units[-1].layout.numel)
        # with a narrower compute dtype a layer's gradient is cast into a staging buffer right away, which
        # frees its accumulator for the next layer at once: one suffices. In fp32 two alternate.
        staged = dtype != torch.float32
        layer_acc = torch.empty(max_layer, device=device)
        self._acc = {0: layer_acc, 1: layer_acc if staged else torch.empty(max_layer, device=device)}
        if tied:
            self._acc["embed"] = torch.empty(units[0].layout.numel, device=device)
            self._acc["head"] = torch.empty(units[-1].layout.numel, device=device)
        else:
            self._acc["embed"] = self._acc["head"] = torch.empty(big, device=device)
        self._acc_free = {id(b): None for b in self._acc.values()}  # buffer -> event: its D2H finished
        self._stage = None
        if dtype != torch.float32:  # a layer's gradient is cast before it leaves; two casts in flight
            self._stage = [torch.empty(max_layer, dtype=dtype, device=device) for _ in range(2)]
            self._stage_free = [None, None]
            self._stage_next = 0

    def _init_adapters(self) -> None:
        """Resident device buffers for every layer's adapters and their gradients (fp32, LoRA only)."""
        adapters = self.store.adapters
        self._adapter_span = []  # adapter j -> (first element, end) in the resident buffers
        lo = 0
        for a in adapters:
            self._adapter_span.append((lo, lo + a.layout.numel))
            lo += a.layout.numel
        self._adapter_w = torch.empty(lo, dtype=torch.float32, device=self.device)
        self._adapter_g = torch.empty(lo, dtype=torch.float32, device=self.device)
        self._adapter_copied: list = [None] * len(adapters)  # event: adapter j's latest H2D finished
        self._adapter_read: list = [None] * len(adapters)  # event: adapter j's last reader finished

    # ---- weights -------------------------------------------------------------------------------------

    def _adapter_of(self, u: int) -> int | None:
        """The adapter unit read with unit u's weights (LoRA): layer u's, or the head's trained final norm."""
        if not self.lora:
            return None
        if 1 <= u <= self.L:
            return u - 1
        return self.head_adapter if u == self.L + 1 else None

    def _slot_of(self, u: int):
        if u == 0:
            assert not (self.cuda and self.host_embed), "untied embeddings are gathered on the host"
            return "embed"
        if u == self.L + 1:
            return "head"
        j = u - 1
        return ((j // self.K) % 2) * self.K + j % self.K

    def prefetch(self, u: int) -> None:
        """Start bringing unit u's current weights to its slot (no-op if they are there already)."""
        slot = self._slot_of(u)
        if self.lora:
            j = self._adapter_of(u)
            if j is not None:
                self._prefetch_adapter(j)
        else:
            self.wait_updated(u)
        want = (u, self.version[u])
        if self._slot_unit.get(slot) == want:
            return
        self._slot_unit[slot] = want
        if not self.cuda:
            return
        unit = self.store.units[u]
        with torch.cuda.stream(self.h2d):
            if self._read[slot] is not None:
                # write-after-read: the slot's previous layer may still be in use by queued compute
                self.h2d.wait_event(self._read[slot])
            n = unit.layout.numel
            # non_blocking from pinned memory: the copy engine runs while the compute stream works
            self._slots[slot][:n].copy_(unit.wire, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
            self._copied[slot] = ev

    def _prefetch_adapter(self, j: int) -> None:
        """Start bringing layer j's adapters to their resident buffer if the optimizer changed them."""
        self.wait_updated(j)
        version = self.adapter_version[j]
        if self._adapter_held.get(j) == version:
            return
        self._adapter_held[j] = version
        if not self.cuda:
            return
        lo, hi = self._adapter_span[j]
        with torch.cuda.stream(self.h2d):
            if self._adapter_read[j] is not None:
                # write-after-read: queued compute may still read the previous version
                self.h2d.wait_event(self._adapter_read[j])
            # non_blocking from the pinned fp32 master: it is rewritten only by the next update, which
            # starts after this step's one host sync, by which time compute has waited for this copy
            self._adapter_w[lo:hi].copy_(self.store.adapters[j].master, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
            self._adapter_copied[j] = ev

    def weights(self, u: int) -> dict[str, torch.Tensor]:
        """Views of unit u's weights on the device, usable by work queued on the compute stream. With LoRA,
        a layer's views include its adapters ("q.lora_A", "q.lora_B", ...)."""
        self.prefetch(u)
        unit = self.store.units[u]
        # fused views (one GEMM for q, k, v and one for gate, up) unless LoRA adapts the projections one by one
        fused = not self.lora
        if not self.cuda:
            w = unit.layout.views(unit.wire, fused)
        else:
            slot = self._slot_of(u)
            # read-after-write: compute must not read the slot before its copy has landed
            self.compute.wait_event(self._copied[slot])
            w = unit.layout.views(self._slots[slot], fused)
        j = self._adapter_of(u)
        if j is not None:
            # the adapters, and trained norms under the base's keys, which they replace
            w.update(self._adapter_views(j))
        return w

    def _adapter_views(self, j: int) -> dict[str, torch.Tensor]:
        adapter = self.store.adapters[j]
        if not self.cuda:
            return adapter.layout.views(adapter.master)
        if self._adapter_copied[j] is not None:
            # read-after-write: the adapters' latest copy must have landed
            self.compute.wait_event(self._adapter_copied[j])
        lo, hi = self._adapter_span[j]
        return adapter.layout.views(self._adapter_w[lo:hi])

    def embed_rows(self, i: int, ids_BT: torch.Tensor) -> torch.Tensor:
        """Embedding rows of micro-batch i, gathered on the host and sent to the device."""
        if not self.lora:
            self.wait_updated(0)
        unit = self.store.units[0]
        V, H = unit.layout.tensors[0].shape
        held = self._gathered.get(i)
        if held is not None:
            held[1].synchronize()  # the pinned rows buffer is rewritten only after its last copy left
        buf = self._host_buffer(("embed_rows", i), torch.empty((*ids_BT.shape, H), dtype=unit.wire.dtype))
        torch.index_select(unit.wire.view(V, H), 0, ids_BT.reshape(-1), out=buf.view(-1, H))
        with torch.cuda.stream(self.h2d):
            dev = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
            dev.copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        self._gathered[i] = (buf, ev)
        # read-after-write: the rows must have landed before the first layer reads them
        self.compute.wait_event(ev)
        dev.record_stream(self.compute)
        return dev

    def release(self, u: int) -> None:
        """Compute work queued so far is the last reader of unit u's slot until it is fetched again."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.compute)
            self._read[self._slot_of(u)] = ev
            j = self._adapter_of(u)
            if j is not None:
                self._adapter_read[j] = ev  # the unit's adapters were read by the same work

    def head_weights(self) -> dict[str, torch.Tensor]:
        w = self.weights(self.L + 1)
        if self.tied:
            w["lm_head"] = self.weights(0)["embed"]
        return w

    def release_head(self) -> None:
        self.release(self.L + 1)
        if self.tied:
            self.release(0)

    # ---- activation checkpoints ----------------------------------------------------------------------

    def stash(self, key, tensors: list[torch.Tensor]) -> None:
        """Keep a checkpoint until the backward asks for it: in pinned host memory when offloading, so
        that device memory does not grow with the layer count."""
        if not (self.cuda and self.offload):
            self._stashed[key] = tensors
            return
        if len(self._stash_events) >= 2:
            # at most two checkpoints in flight to the host: the activations they hold are freed only
            # once their copy has read them, so an unbounded lead would grow device memory with L
            self.compute.wait_event(self._stash_events.pop(0))
        ready = torch.cuda.Event()
        ready.record(self.compute)
        host = []
        with torch.cuda.stream(self.d2h):
            # the activations are final once the compute stream has produced them
            self.d2h.wait_event(ready)
            for i, t in enumerate(tensors):
                buf = self._host_buffer((key, i), t)
                buf.copy_(t, non_blocking=True)
                # the allocator must not hand t's memory to new work before this copy has read it
                t.record_stream(self.d2h)
                host.append(buf)
            sent = torch.cuda.Event()
            sent.record(self.d2h)
        self._stash_events.append(sent)
        self._sent[key] = sent
        self._stashed[key] = host

    def prefetch_stash(self, key) -> None:
        """Start bringing an offloaded checkpoint back to the device."""
        if not (self.cuda and self.offload) or key in self._returning:
            return
        host = self._stashed[key]
        with torch.cuda.stream(self.h2d):
            # read-after-write across the copy streams: the pinned buffers hold this checkpoint only once
            # its copy to the host has finished (the top blocks' come back while theirs may be queued)
            self.h2d.wait_event(self._sent.pop(key))
            # allocated on the copy stream, released to the allocator only after compute has used it
            dev = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in host]
            for d, h in zip(dev, host):
                d.copy_(h, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        self._returning[key] = (dev, ev)

    def unstash(self, key) -> list[torch.Tensor]:
        if not (self.cuda and self.offload):
            return self._stashed.pop(key)
        self.prefetch_stash(key)
        dev, ev = self._returning.pop(key)
        del self._stashed[key]
        # read-after-write: the checkpoint must have landed before the recompute reads it
        self.compute.wait_event(ev)
        for d in dev:
            d.record_stream(self.compute)
        return dev

    def _host_buffer(self, key, like: torch.Tensor) -> torch.Tensor:
        buf = self._host_pool.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            # pinned once and reused every step: pinning costs far more than the copy
            if buf is not None:
                self.store.pool.free(buf)
            buf = self.store.pool.empty(like.shape, like.dtype)
            self._host_pool[key] = buf
        return buf

    # ---- gradients -----------------------------------------------------------------------------------

    def accumulator(self, u: int) -> torch.Tensor:
        """A zeroed fp32 flat buffer for unit u's gradient, on the device."""
        unit = self.store.units[u]
        n = unit.layout.numel
        if not self.cuda:
            if unit.grad.dtype == torch.float32:
                return unit.grad.zero_()  # on the CPU the host buffer is the accumulator
            return torch.zeros(n)
        key = "embed" if u == 0 else "head" if u == self.L + 1 else (u - 1) % 2
        buf = self._acc[key]
        free = self._acc_free[id(buf)]
        if free is not None:
            # the buffer's previous gradient must have left for the host before it is overwritten
            self.compute.wait_event(free)
        return buf[:n].zero_()

    def flush(self, u: int, acc: torch.Tensor) -> None:
        """Unit u's gradient is complete in acc: count it in the norm and send it to the host."""
        unit = self.store.units[u]
        self.norm_sq += torch.linalg.vector_norm(acc).square()
        if not self.cuda:
            if acc.data_ptr() != unit.grad.data_ptr():
                unit.grad.copy_(acc)
            return
        if self._stage is None:
            self._d2h(unit.grad, acc)
            # the accumulator is reused only once its D2H has read it
            self._acc_free[id(self._acc_buffer_of(acc))] = self._last_d2h
            return
        # narrowed piece by piece through the two layer-sized staging buffers, so that the vocab-sized
        # units need no cast buffer of their own
        size = self._stage[0].numel()
        for lo in range(0, acc.numel(), size):
            hi = min(lo + size, acc.numel())
            i = self._stage_next
            self._stage_next ^= 1
            if self._stage_free[i] is not None:
                self.compute.wait_event(self._stage_free[i])  # staging buffer drained by its last D2H
            piece = self._stage[i][: hi - lo]
            piece.copy_(acc[lo:hi])
            self._d2h(unit.grad[lo:hi], piece)
            self._stage_free[i] = self._last_d2h
        # the casts above ran on the compute stream: the accumulator is free for the next unit already

    def adapter_grads(self, j: int) -> dict[str, torch.Tensor]:
        """Zeroed fp32 views for layer j's adapter gradients: the resident device buffer on CUDA, the host
        gradient buffer on the CPU."""
        adapter = self.store.adapters[j]
        if self.cuda:
            lo, hi = self._adapter_span[j]
            # the previous step's D2H of this range finished in its finish_backward (d2h synchronised)
            buf = self._adapter_g[lo:hi]
        else:
            buf = adapter.grad
        return adapter.layout.views(buf.zero_())

    def flush_adapter(self, j: int) -> None:
        """Layer j's adapter gradients are complete: count them in the norm and send them to the host."""
        adapter = self.store.adapters[j]
        if not self.cuda:
            self.norm_sq += torch.linalg.vector_norm(adapter.grad).square()
            return
        lo, hi = self._adapter_span[j]
        grad = self._adapter_g[lo:hi]
        self.norm_sq += torch.linalg.vector_norm(grad).square()
        # the range is written once a step: no reuse to guard, the copy only waits for the compute
        self._d2h(adapter.grad, grad)

    def updated(self, u: int) -> None:
        """The optimizer has written trained unit u's new weights (with LoRA: layer u's adapters)."""
        if self.lora:
            self.adapter_version[u] += 1
        else:
            self.version[u] += 1

    def _d2h(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        produced = torch.cuda.Event()
        produced.record(self.compute)
        with torch.cuda.stream(self.d2h):
            # the gradient is final only once the compute stream has finished writing it
            self.d2h.wait_event(produced)
            host.copy_(dev, non_blocking=True)
            self._last_d2h = torch.cuda.Event()
            self._last_d2h.record(self.d2h)

    def _acc_buffer_of(self, acc: torch.Tensor) -> torch.Tensor:
        for buf in self._acc.values():
            if buf.data_ptr() == acc.data_ptr():
                return buf
        raise AssertionError("flush of a tensor that is not an accumulator")

    def finish_backward(self) -> float:
        """Wait for every gradient to reach the host; return the global gradient norm (one sync a step)."""
        norm = float(self.norm_sq.sqrt())
        if self.cuda:
            self.d2h.synchronize()
        self.norm_sq.zero_()
        return norm

    def device_bytes(self) -> dict[str, int]:
        if not self.cuda:
            return {}
        out = {
            "weight_slots": sum(b.nbytes for b in self._slots.values()),
            "grad_accumulators": sum({id(b): b.nbytes for b in self._acc.values()}.values()),
        }
        if self.lora:
            out["adapter_weights"] = self._adapter_w.nbytes
            out["adapter_grads"] = self._adapter_g.nbytes
        if self._stage is not None:
            out["grad_staging"] = sum(b.nbytes for b in self._stage)
        return out

    def reset(self) -> None:
        """Forget a step's in-flight state after it failed: wait for the device, drop stashed tensors."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._stashed.clear()
        self._returning.clear()
        self._stash_events.clear()
        self._sent.clear()
        self.norm_sq.zero_()
        # what the device is believed to hold: a copy cut short by the failure may not have been queued
        self._slot_unit.clear()
        self._adapter_held.clear()

    def host_checkpoint_bytes(self) -> int:
        return sum(b.nbytes for b in self._host_pool.values())
