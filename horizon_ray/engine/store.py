"""Host store: every parameter, gradient and AdamW moment of the model, in host RAM, one flat buffer per
unit and kind. The device never owns a parameter; it borrows the ``wire`` copy of a unit for a while.

Bytes per parameter, by mode:
- "exact", float32 compute: master fp32 (4) + m, v fp32 (8) + gradient fp32 (4); the master is the wire: 16.
- "exact", bfloat16 compute: master fp32 (4) + m, v fp32 (8) + one bf16 buffer (2) that is the wire copy of
  the weights and, between a unit's backward and its update, its gradient: 14. The wire's last reader in
  a step is the unit's backward, the gradient's first writer comes after it, and the update reads the
  gradient chunk by chunk before it writes the new wire chunk over it.
- "bf16-state": master, m, v, gradient in bf16; the master is the wire: 8.
- LoRA (``adapter_layouts`` given): the base is frozen, each unit holds only its wire in the compute dtype
  (2 in bfloat16, 4 in float32), which is also its ``master``; it has no moments, gradient or update. The
  adapters (one unit per layer, ``self.adapters``) are trained units in fp32 whose master is their wire,
  with fp32 m, v and gradient: 16 per adapter parameter. ``trained`` lists what the optimizer updates.
On CUDA the wire and gradient buffers are page-locked (pageable copies run at a seventh of the speed),
once, unit by unit, at start, at their exact size (see pinned.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from horizon_ray.engine.model import UnitLayout
from horizon_ray.engine.pinned import PinnedPool


@dataclass
class UnitState:
    layout: UnitLayout
    master: torch.Tensor  # flat, master dtype: the authoritative weights
    exp_avg: torch.Tensor  # AdamW first moment
    exp_avg_sq: torch.Tensor  # AdamW second moment
    grad: torch.Tensor  # flat, gradient of the step (summed over micro-batches); may alias wire
    wire: torch.Tensor  # flat, compute dtype: what crosses to the device; may alias master or grad
    step: torch.Tensor  # float32 scalar, AdamW step count (torch.optim.AdamW keeps it as a tensor)


class HostStore:
    def __init__(self, layouts: list[UnitLayout], compute_dtype: torch.dtype, master_dtype: torch.dtype,
                 pin: bool, adapter_layouts: list[UnitLayout] | None = None):
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        self.master_dtype = master_dtype
        self.pinned = pin
        self.pool = PinnedPool(pin)
        self.frozen = adapter_layouts is not None  # LoRA: the base units are never updated
        # the gradient shares the wire's buffer when the wire is a narrowed copy of the master
        self.grad_is_wire = not self.frozen and master_dtype != compute_dtype
        if self.frozen:
            self.units = [self._frozen_unit(layout, compute_dtype) for layout in layouts]
        else:
            self.units = [self._trained_unit(layout, compute_dtype, master_dtype) for layout in layouts]
        # fp32 adapters: the master is the wire (it crosses as is), the gradient has its own fp32 buffer
        self.adapters = [self._trained_unit(layout, torch.float32, torch.float32)
                         for layout in adapter_layouts or []]
        self.trained: list[UnitState] = self.adapters if self.frozen else self.units
        self.by_name = {u.layout.name: u for u in self.units + self.adapters}

    def _trained_unit(self, layout: UnitLayout, compute_dtype: torch.dtype, master_dtype: torch.dtype) -> UnitState:
        n = layout.numel
        if master_dtype != compute_dtype:
            master = torch.empty(n, dtype=master_dtype)
            wire = grad = self.pool.empty(n, compute_dtype, zero=True)
        else:
            master = self.pool.empty(n, master_dtype)
            wire, grad = master, self.pool.empty(n, compute_dtype, zero=True)
        return UnitState(
            layout=layout,
            master=master,
            exp_avg=torch.zeros(n, dtype=master_dtype),
            exp_avg_sq=torch.zeros(n, dtype=master_dtype),
            grad=grad,
            wire=wire,
            step=torch.tensor(0.0),
        )

    def _frozen_unit(self, layout: UnitLayout, compute_dtype: torch.dtype) -> UnitState:
        wire = self.pool.empty(layout.numel, compute_dtype)
        none = torch.empty(0, dtype=compute_dtype)  # no moments, no gradient: never updated
        return UnitState(layout=layout, master=wire, exp_avg=none, exp_avg_sq=none, grad=none, wire=wire,
                         step=torch.tensor(0.0))

    @property
    def num_params(self) -> int:
        """Parameters of the model (the base; adapters not counted)."""
        return sum(u.layout.numel for u in self.units)

    @property
    def trainable_params(self) -> int:
        return sum(u.layout.numel for u in self.trained)

    def refresh_wire(self, unit: UnitState) -> None:
        if unit.wire is not unit.master:
            unit.wire.copy_(unit.master)

    def refresh_all_wires(self) -> None:
        """Rebuild every wire from the master, e.g. after a step failed with gradients in the wire."""
        for u in self.units:
            self.refresh_wire(u)

    def bytes_by_kind(self) -> dict[str, int]:
        """Host bytes the store holds, by kind (what the planner predicts)."""
        out = {"master": 0, "moments": 0, "grads": 0, "wire": 0}
        if self.frozen:  # the frozen base is only its wire
            out["wire"] += sum(u.wire.nbytes for u in self.units)
        for u in self.trained:
            out["master"] += u.master.nbytes
            out["moments"] += u.exp_avg.nbytes + u.exp_avg_sq.nbytes
            out["grads"] += u.grad.nbytes
            if u.wire is not u.master and u.wire is not u.grad:
                out["wire"] += u.wire.nbytes
        return out
