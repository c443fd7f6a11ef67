"""Host store: every parameter, gradient and AdamW moment of the model, in host RAM, one flat buffer per
unit and kind. The device never owns a parameter; it borrows the ``wire`` copy of a unit for a while.

Bytes per parameter, by mode:
- "exact", float32 compute: master fp32 (4) + m, v fp32 (8) + gradient fp32 (4); the master is the wire: 16.
- "exact", bfloat16 compute: master fp32 (4) + m, v fp32 (8) + one bf16 buffer (2) that is the wire copy of
  the weights and, between a unit's backward and its update, its gradient: 14. The wire's last reader in
  a step is the unit's backward, the gradient's first writer comes after it, and the update reads the
  gradient chunk by chunk before it writes the new wire chunk over it.
- "bf16-state": master, m, v, gradient in bf16; the master is the wire: 8.
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
                 pin: bool):
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        self.master_dtype = master_dtype
        self.pinned = pin
        self.pool = PinnedPool(pin)
        self.units: list[UnitState] = []
        # the gradient shares the wire's buffer when the wire is a narrowed copy of the master
        self.grad_is_wire = master_dtype != compute_dtype
        for layout in layouts:
            n = layout.numel
            if self.grad_is_wire:
                master = torch.empty(n, dtype=master_dtype)
                wire = grad = self.pool.empty(n, compute_dtype, zero=True)
            else:
                master = self.pool.empty(n, master_dtype)
                wire, grad = master, self.pool.empty(n, compute_dtype, zero=True)
            self.units.append(UnitState(
                layout=layout,
                master=master,
                exp_avg=torch.zeros(n, dtype=master_dtype),
                exp_avg_sq=torch.zeros(n, dtype=master_dtype),
                grad=grad,
                wire=wire,
                step=torch.tensor(0.0),
            ))
        self.by_name = {u.layout.name: u for u in self.units}

    @property
    def num_params(self) -> int:
        return sum(u.layout.numel for u in self.units)

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
        for u in self.units:
            out["master"] += u.master.nbytes
            out["moments"] += u.exp_avg.nbytes + u.exp_avg_sq.nbytes
            out["grads"] += u.grad.nbytes
            if u.wire is not u.master and u.wire is not u.grad:
                out["wire"] += u.wire.nbytes
        return out
