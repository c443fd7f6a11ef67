"""Host store: every parameter, gradient and AdamW moment of the model, in host RAM, one flat buffer per
unit and kind. The device never owns a parameter; it borrows the ``wire`` copy of a unit for a while.

Per parameter, mode "exact": master fp32 (4 B) + m, v fp32 (8 B) + gradient in the compute dtype
(4 or 2 B) + a wire copy in the compute dtype when it differs from the master's (2 B for bf16): 16 B in
both compute dtypes. The embedding and head units keep fp32 gradients in every mode (2 B more for their
parameters with bf16 compute): they leave the device straight from the fp32 accumulator, which spares the
device a cast buffer of [vocab x hidden]. Mode "bf16-state": master, m, v and gradient in bf16, the master
is the wire: 8 B.
On CUDA the wire and gradient buffers are pinned (pageable copies run at a seventh of the speed), once,
unit by unit, at start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from horizon_ray.engine.model import UnitLayout


@dataclass
class UnitState:
    layout: UnitLayout
    master: torch.Tensor  # flat, master dtype: the authoritative weights
    exp_avg: torch.Tensor  # AdamW first moment
    exp_avg_sq: torch.Tensor  # AdamW second moment
    grad: torch.Tensor  # flat, gradient of the last step (already summed over micro-batches)
    wire: torch.Tensor  # flat, compute dtype: what crosses to the device (may alias master)
    step: torch.Tensor  # float32 scalar, AdamW step count (torch.optim.AdamW keeps it as a tensor)


class HostStore:
    def __init__(self, layouts: list[UnitLayout], compute_dtype: torch.dtype, master_dtype: torch.dtype,
                 pin: bool):
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        self.master_dtype = master_dtype
        self.pinned = pin
        self.units: list[UnitState] = []
        for i, layout in enumerate(layouts):
            n = layout.numel
            end_unit = i in (0, len(layouts) - 1)
            grad_dtype = torch.float32 if end_unit else compute_dtype
            master = torch.empty(n, dtype=master_dtype, pin_memory=pin and master_dtype == compute_dtype)
            wire = master if master_dtype == compute_dtype else torch.empty(n, dtype=compute_dtype, pin_memory=pin)
            self.units.append(UnitState(
                layout=layout,
                master=master,
                exp_avg=torch.zeros(n, dtype=master_dtype),
                exp_avg_sq=torch.zeros(n, dtype=master_dtype),
                grad=torch.zeros(n, dtype=grad_dtype, pin_memory=pin),
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

    def bytes_by_kind(self) -> dict[str, int]:
        """Host bytes the store holds, by kind (what the planner predicts)."""
        out = {"master": 0, "moments": 0, "grads": 0, "wire": 0}
        for u in self.units:
            out["master"] += u.master.nbytes
            out["moments"] += u.exp_avg.nbytes + u.exp_avg_sq.nbytes
            out["grads"] += u.grad.nbytes
            if u.wire is not u.master:
                out["wire"] += u.wire.nbytes
        return out
