"""Host store: every parameter, gradient and AdamW moment of the model, in host RAM, one flat buffer per
unit and kind. The device never owns a parameter; it borrows a unit's *wire* (its weights in the compute
dtype) for a while.

Bytes per parameter, by precision and update mode (the planner's table, modes.py, says the same):
- "exact", bfloat16 compute: master fp32 (4) + m, v fp32 (8) + one bf16 buffer (2) that is the wire and,
  between a unit's backward and its update, its gradient: 14. The wire's last reader in a step is the unit's
  backward, the gradient's first writer comes after it, and the update reads the gradient chunk by chunk
  before it writes the new wire chunk over it.
- "exact", float32 compute: the master is the wire; the gradient has its own fp32 buffer: 16.
- "bf16-state": master, m, v in bf16 (the master is the wire) and a bf16 gradient: 8.
- update "delayed": two wire/gradient buffers that swap roles each step (step k reads and writes buffer k % 2
  while the update of step k - 1 reads and rewrites the other): +2 (bf16) or +4 (fp32) a parameter, the
  master separate from the wires.
- update "speculative": units updated during the backward keep their gradient apart from the wire (a rollback
  needs it after the wire was rewritten): +2 a parameter of those units in bf16 exact mode, nothing where the
  gradient has its own buffer anyway.
- LoRA (``adapter_layouts`` given): the base is frozen, each unit holds only its wire in the compute dtype
  (2 in bfloat16, 4 in float32), which is also its ``master``; it has no moments, gradient or update. The
  adapters (one unit per layer, ``self.adapters``) are trained units in fp32 whose master is their wire, with
  fp32 m, v and gradient: 16 per adapter parameter. ``trained`` lists what the optimizer updates.
- LoRA with ``quantize`` (nf4, fp4, int8): each decoder layer's wire is a flat uint8 buffer of its packed
  tensors (quant.py, ``packed[u]`` says where each part sits): ~0.52 bytes a projection weight in nf4, 1 (+ a
  row scale) in int8; the embedding and head units stay in the compute dtype.
On CUDA the wire and gradient buffers are page-locked (pageable copies run at a seventh of the speed),
once, unit by unit, at start, at their exact size (see pinned.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from horizon_ray.engine.model import UnitLayout
from horizon_ray.engine.pinned import PinnedPool
from horizon_ray.engine.quant import PackedLayout


@dataclass
class UnitState:
    layout: UnitLayout
    master: torch.Tensor  # flat, master dtype: the authoritative weights
    exp_avg: torch.Tensor  # AdamW first moment
    exp_avg_sq: torch.Tensor  # AdamW second moment
    wires: list[torch.Tensor]  # flat, compute dtype: what crosses to the device, one or two (see wire())
    grad_own: torch.Tensor | None  # a gradient buffer of its own; None: the gradient shares the step's wire
    step: torch.Tensor  # float32 scalar, AdamW step count (torch.optim.AdamW keeps it as a tensor)
    # one counter per wire, bumped each time that wire is rewritten: a device copy of it is current while
    # the counter it was made at is
    wire_ids: list[int] = field(default_factory=lambda: [0, 0])

    def wire_of(self, k: int) -> torch.Tensor:
        """The wire step k reads (two alternate under the delayed update; one otherwise)."""
        return self.wires[k % len(self.wires)]

    def grad_of(self, k: int) -> torch.Tensor:
        """Where step k's gradient lands."""
        return self.grad_own if self.grad_own is not None else self.wire_of(k)

    @property
    def wire(self) -> torch.Tensor:
        """The wire of even steps (the only one outside the delayed update)."""
        return self.wires[0]

    @property
    def grad(self) -> torch.Tensor:
        return self.grad_of(0)

    def wire_key(self, k: int = 0) -> tuple[int, int]:
        """Which wire step k reads and how often it was rewritten: equal keys, equal bytes."""
        i = k % len(self.wires)
        return i, self.wire_ids[i]

    def wire_written(self, k: int = 0) -> None:
        self.wire_ids[k % len(self.wires)] += 1


def packed_layouts(layouts: list[UnitLayout], quantize: str, compute_dtype: torch.dtype,
                   nested: bool = True) -> list[PackedLayout | None]:
    """Where each unit's packed tensors sit under ``quantize``: the decoder layers are packed, the embedding and
    the head (the first and last units) never; None for a unit kept in the compute dtype."""
    return [PackedLayout(layout, quantize, compute_dtype, nested) if quantize != "none" and 0 < u < len(layouts) - 1
            else None for u, layout in enumerate(layouts)]


class HostStore:
    def __init__(self, layouts: list[UnitLayout], compute_dtype: torch.dtype, master_dtype: torch.dtype,
                 pin: bool, adapter_layouts: list[UnitLayout] | None = None, wires: int = 1,
                 own_grads: frozenset[int] = frozenset(), world: int = 1, quantize: str = "none",
                 nested: bool = True):
        """``wires``: 2 for the delayed update; ``own_grads``: trained units whose gradient must not share the
        wire (the units the speculative update may roll back); ``world`` > 1: every buffer in shared memory,
        for that many ranks to map (ranks.py), each pinning it in its own CUDA context (``attach``);
        ``quantize`` (LoRA only): how the frozen layers are packed (model.QUANTIZE); ``nested``: 4-bit block
        scales double-quantized (False only for a checkpoint saved so, model.stored_nested)."""
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        self.master_dtype = master_dtype
        self.pinned = pin
        self.world = world
        self.pool = PinnedPool(pin and world == 1, shared=world > 1)
        self.frozen = adapter_layouts is not None  # LoRA: the base units are never updated
        assert self.frozen or quantize == "none", "only a frozen base is quantized"
        self.quantize = quantize
        # unit -> where its packed tensors sit (None: a flat buffer in the compute dtype, UnitLayout's views)
        self.packed = packed_layouts(layouts, quantize, compute_dtype, nested)
        if self.frozen:
            self.units = [self._frozen_unit(layout, compute_dtype, self.packed[u]) for u, layout in enumerate(layouts)]
        else:
            self.units = [self._trained_unit(layout, compute_dtype, master_dtype, wires, u in own_grads)
                          for u, layout in enumerate(layouts)]
        # fp32 adapters: the master is the wire (it crosses as is), the gradient has its own fp32 buffer
        self.adapters = [self._trained_unit(layout, torch.float32, torch.float32, 1, True)
                         for layout in adapter_layouts or []]
        self.trained: list[UnitState] = self.adapters if self.frozen else self.units
        self.by_name = {u.layout.name: u for u in self.units + self.adapters}
        # several ranks: the updates fence's table of versions, one row per rank (ranks.SharedFence)
        self.versions = torch.zeros(world, len(self.trained), dtype=torch.int64).share_memory_() \
            if world > 1 else None

    def __getstate__(self):
        # a rank receives the store through torch.multiprocessing (shared memory); the pool is per process
        state = dict(self.__dict__)
        state["pool"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.pool = PinnedPool(False)

    def attach(self, pin: bool) -> None:
        """In a rank's process: page-lock the buffers that cross PCIe in this process's CUDA context."""
        self.pool = PinnedPool(pin)
        self.pinned = pin
        for unit in self.units + self.adapters:
            unit.step = unit.step.clone()  # each rank counts the steps of its shard's AdamW
            for t in (*unit.wires, unit.grad_own):
                if t is not None:
                    self.pool.register(t)

    def _trained_unit(self, layout: UnitLayout, compute_dtype: torch.dtype, master_dtype: torch.dtype,
                      wires: int, own_grad: bool) -> UnitState:
        n = layout.numel
        if wires == 1 and master_dtype == compute_dtype:
            master = self.pool.empty(n, master_dtype)  # the master crosses as is
            wire_list = [master]
            own_grad = True
        else:
            master = torch.empty(n, dtype=master_dtype)
            wire_list = [self.pool.empty(n, compute_dtype, zero=True) for _ in range(wires)]
        return UnitState(
            layout=layout,
            master=master,
            exp_avg=torch.zeros(n, dtype=master_dtype),
            exp_avg_sq=torch.zeros(n, dtype=master_dtype),
            wires=wire_list,
            grad_own=self.pool.empty(n, compute_dtype, zero=True) if own_grad else None,
            step=torch.tensor(0.0),
        )

    def _frozen_unit(self, layout: UnitLayout, compute_dtype: torch.dtype, packed: PackedLayout | None) -> UnitState:
        wire = self.pool.empty(layout.numel, compute_dtype) if packed is None else \
            self.pool.empty(packed.nbytes, torch.uint8)
        none = torch.empty(0, dtype=compute_dtype)  # no moments, no gradient: never updated
        return UnitState(layout=layout, master=wire, exp_avg=none, exp_avg_sq=none, wires=[wire], grad_own=none,
                         step=torch.tensor(0.0))

    @property
    def num_params(self) -> int:
        """Parameters of the model (the base; adapters not counted)."""
        return sum(u.layout.numel for u in self.units)

    @property
    def trainable_params(self) -> int:
        return sum(u.layout.numel for u in self.trained)

    def relayout(self, wires: int, own_grads: frozenset[int]) -> None:
        """Change the buffers of the trained units to those of another update mode (see __init__), keeping
        the weights: wires are added from the master or freed, gradient buffers added or freed. Where one wire
        is the master (fp32 compute, bf16-state), the delayed update's two wires are copies beside it."""
        assert not self.frozen, "LoRA keeps one layout"
        master_is_wire = wires == 1 and self.master_dtype == self.compute_dtype
        for u, unit in enumerate(self.units):
            n = unit.layout.numel
            kept = [w for w in unit.wires if w is not unit.master]
            if master_is_wire:
                target = [unit.master]
            else:
                target = kept[:wires]
                while len(target) < wires:
                    target.append(self.pool.empty(n, self.compute_dtype))
                    target[-1].copy_(unit.master)
            for w in kept:
                if not any(w is t for t in target):
                    self.pool.free(w)
            unit.wires = target
            unit.wire_ids = [i + 1 for i in unit.wire_ids]  # every device copy is stale
            own = master_is_wire or u in own_grads
            if own and unit.grad_own is None:
                unit.grad_own = self.pool.empty(n, self.compute_dtype, zero=True)
            elif not own and unit.grad_own is not None:
                self.pool.free(unit.grad_own)
                unit.grad_own = None

    @property
    def grad_is_wire(self) -> bool:
        """Some trained unit's gradient lands in its wire (a failed step must rebuild the wires)."""
        return any(u.grad_own is None for u in self.trained)

    def refresh_wire(self, unit: UnitState) -> None:
        """Every wire of the unit from its master (after a load, or a step that left gradients in them)."""
        for i, w in enumerate(unit.wires):
            if w is not unit.master:
                w.copy_(unit.master)
            unit.wire_written(i)

    def refresh_all_wires(self) -> None:
        for u in self.units:
            self.refresh_wire(u)

    def bytes_by_kind(self) -> dict[str, int]:
        """Host bytes the store holds, by kind (what the planner predicts)."""
        out = {"master": 0, "moments": 0, "grads": 0, "wire": 0}
        if self.frozen:  # the frozen base is only its wire
            out["wire"] += sum(u.master.nbytes for u in self.units)
        for u in self.trained:
            out["master"] += u.master.nbytes
            out["moments"] += u.exp_avg.nbytes + u.exp_avg_sq.nbytes
            if u.grad_own is not None:
                out["grads"] += u.grad_own.nbytes
            out["wire"] += sum(w.nbytes for w in u.wires if w is not u.master)
        return out
