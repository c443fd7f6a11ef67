"""Unit weights on the compute device: what the layer template reads, and the copies that bring it there.

Before a step reads a unit it waits, at the ``updates`` fence, for the update the step needs (step k needs
the update of step k - 1; under the delayed update that of step k - 2), then reads the wire of step k.

On CUDA (``DeviceWeights``) the layers take a pool of 2 groups x K slots (units.py), so a block of K layers
stays resident for its recompute and backward while the next block streams into the other group: each layer
crosses PCIe twice a step, and the top two blocks, still resident when the backward starts, once. The
embedding and the head have a slot each; an untied embedding never needs its whole table on the device: the
rows of a micro-batch are gathered on the host and only [tokens x hidden] crosses. A slot remembers which
wire (and which rewrite of it) it holds, so a copy that would bring the same bytes again is skipped. With
LoRA each slot has an fp32 adapter slot beside it: a layer's adapters travel with its base weights, so
device memory does not grow with the layer count. A quantized base (quant.py) crosses packed: a layer slot
is then a uint8 buffer of the largest packed layer, and reading a layer dequantizes its projections from the
slot into the compute dtype (bitsandbytes' kernels on the device), for that read only.

On the CPU (``HostWeights``) the views are the host buffers themselves and copies are free.
"""

from __future__ import annotations

import torch

from horizon_ray.engine.fence import Fence
from horizon_ray.engine.pinned import HostBuffers
from horizon_ray.engine.store import HostStore
from horizon_ray.engine.units import Units


class HostWeights:
    def __init__(self, store: HostStore, units: Units, updates: Fence, lag: int, fuse: bool = True):
        self.store = store
        self.units = units
        self.updates = updates  # waited on before a trained unit (or adapter) is read
        self.lag = lag  # 1 under the delayed update: step k reads the weights after the update of step k - 2
        self.lora = bool(store.adapters)  # a frozen base without adapters (generation) reads as a plain model
        # q, k, v and gate, up each one GEMM (EngineConfig.fuse_projections); LoRA adapts them one by one
        self.fused = fuse and not self.lora
        heads = [a for a, u in enumerate(store.adapters) if u.layout.name == "lora.head"]
        self.head_adapter: int | None = heads[0] if heads else None
        self.host_embed = False

    def _wait(self, u: int, k: int) -> int | None:
        """Wait for what step k needs of unit u; the adapter read with it (LoRA), if any."""
        a = self.units.adapter_of(u, self.head_adapter) if self.lora else None
        if a is not None:
            self.updates.wait(a, k - self.lag)
        elif not self.lora:
            self.updates.wait(u, k - self.lag)
        return a

    def prefetch(self, u: int, k: int) -> None:
        self._wait(u, k)

    def weights(self, u: int, k: int) -> dict[str, torch.Tensor]:
        """Views of unit u's weights for step k (with LoRA, its adapters under "q.lora_A", ... and trained
        norms under the base's keys, which they replace)."""
        a = self._wait(u, k)
        unit = self.store.units[u]
        w = self._views(u, unit.wire_of(k))
        if a is not None:
            adapter = self.store.adapters[a]
            w.update(adapter.layout.views(adapter.master))
        return w

    def _views(self, u: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Unit u's tensors in a flat buffer of its wire (a packed layer's dequantized)."""
        packed = self.store.packed[u]
        if packed is not None:
            return packed.views(flat)
        return self.store.units[u].layout.views(flat, self.fused)

    def head_weights(self, k: int) -> dict[str, torch.Tensor]:
        w = self.weights(self.units.head, k)
        if "lm_head" not in w:  # tied: the embedding's table
            w["lm_head"] = self.weights(self.units.embed, k)["embed"]
        return w

    def release(self, u: int) -> None:
        pass

    def release_head(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def device_bytes(self) -> dict[str, int]:
        return {}


class DeviceWeights(HostWeights):
    def __init__(self, store: HostStore, units: Units, updates: Fence, lag: int, device: torch.device,
                 buffers: HostBuffers, h2d: torch.cuda.Stream, fuse: bool = True):
        super().__init__(store, units, updates, lag, fuse)
        self.device = device
        self.buffers = buffers
        self.compute = torch.cuda.current_stream(device)
        self.h2d = h2d
        tied = all(t.key != "lm_head" for t in store.units[-1].layout.tensors)
        self.host_embed = not tied
        dtype = store.compute_dtype
        layers = store.units[1:-1]
        # a packed layer's wire is bytes (uint8), an unpacked one's elements of the compute dtype
        layer_dtype = torch.uint8 if store.quantize != "none" else dtype
        max_layer = max((u.wire.numel() for u in layers), default=1)
        # slot key -> flat device buffer. Layer slots are ints, the embedding and head slots are named.
        self._slots: dict[int | str, torch.Tensor] = {
            s: torch.empty(max_layer, dtype=layer_dtype, device=device) for s in range(units.layer_slots)}
        if not self.host_embed:
            self._slots["embed"] = torch.empty(store.units[0].layout.numel, dtype=dtype, device=device)
        self._slots["head"] = torch.empty(store.units[-1].layout.numel, dtype=dtype, device=device)
        self._adapter_slots: dict[int | str, torch.Tensor] = {}
        if self.lora:
            max_adapter = max((a.layout.numel for a in store.adapters), default=1)
            self._adapter_slots = {s: torch.empty(max_adapter, device=device) for s in self._slots}
        self._held: dict = {}  # slot -> (unit, wire key, adapter wire key) it holds or is receiving
        # slot -> event: its H2D copies finished
        self._copied: dict[int | str, torch.cuda.Event | None] = dict.fromkeys(self._slots)
        # slot -> event: its last reader finished
        self._read: dict[int | str, torch.cuda.Event | None] = dict.fromkeys(self._slots)
        self._gathered: dict = {}  # micro-batch index -> event: the H2D of its gathered rows finished

    def prefetch(self, u: int, k: int) -> None:
        """Start bringing unit u's weights for step k to its slot (no-op if they are there already)."""
        a = self._wait(u, k)
        unit = self.store.units[u]
        adapter = self.store.adapters[a] if a is not None else None
        slot = self.units.slot(u)
        want = (u, unit.wire_key(k), adapter.wire_key() if adapter is not None else None)
        held = self._held.get(slot)
        if held == want:
            return
        self._held[slot] = want
        with torch.cuda.stream(self.h2d):
            read = self._read[slot]
            if read is not None:
                # write-after-read: the slot's previous unit may still be in use by queued compute
                self.h2d.wait_event(read)
            # non_blocking from pinned memory: the copy engine runs while the compute stream works. The wire
            # is rewritten only by an update that the fence orders after this step's last read of it.
            if held is None or held[:2] != want[:2]:
                self._slots[slot][:unit.wire.numel()].copy_(unit.wire_of(k), non_blocking=True)
            if adapter is not None and (held is None or held[0] != u or held[2] != want[2]):
                self._adapter_slots[slot][:adapter.layout.numel].copy_(adapter.master, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
            self._copied[slot] = ev

    def weights(self, u: int, k: int) -> dict[str, torch.Tensor]:
        self.prefetch(u, k)
        unit = self.store.units[u]
        slot = self.units.slot(u)
        copied = self._copied[slot]
        assert copied is not None, "prefetch started the slot's copy"
        # read-after-write: compute must not read the slot before its copy has landed
        self.compute.wait_event(copied)
        w = self._views(u, self._slots[slot][:unit.wire.numel()])
        a = self.units.adapter_of(u, self.head_adapter) if self.lora else None
        if a is not None:
            adapter = self.store.adapters[a]
            w.update(adapter.layout.views(self._adapter_slots[slot][:adapter.layout.numel]))
        return w

    def embed_rows(self, i: int, ids_BT: torch.Tensor, k: int) -> torch.Tensor:
        """Embedding rows of micro-batch i for step k, gathered on the host and sent to the device."""
        u = self.units.embed
        self._wait(u, k)
        unit = self.store.units[u]
        wire = unit.wire_of(k)
        V, H = unit.layout.tensors[0].shape
        if self._gathered.get(i) is not None:
            self._gathered[i].synchronize()  # the pinned rows buffer is rewritten only after its last copy left
        buf = self.buffers.get(("embed_rows", i), (*ids_BT.shape, H), wire.dtype)
        torch.index_select(wire.view(V, H), 0, ids_BT.reshape(-1), out=buf.view(-1, H))
        with torch.cuda.stream(self.h2d):
            dev = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
            dev.copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        self._gathered[i] = ev
        # read-after-write: the rows must have landed before the first layer reads them
        self.compute.wait_event(ev)
        dev.record_stream(self.compute)
        return dev

    def release(self, u: int) -> None:
        """Compute work queued so far is the last reader of unit u's slot until it is fetched again."""
        ev = torch.cuda.Event()
        ev.record(self.compute)
        self._read[self.units.slot(u)] = ev

    def release_head(self) -> None:
        self.release(self.units.head)
        if not self.host_embed:
            self.release(self.units.embed)

    def reset(self) -> None:
        # what the device is believed to hold: a copy cut short by a failure may not have been queued
        self._held.clear()

    def device_bytes(self) -> dict[str, int]:
        out = {"weight_slots": sum(b.nbytes for b in self._slots.values())}
        if self._adapter_slots:
            out["adapter_slots"] = sum(b.nbytes for b in self._adapter_slots.values())
        return out
