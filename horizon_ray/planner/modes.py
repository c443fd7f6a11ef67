"""Precision modes: what each one keeps on the host, byte for byte, and what it gives up.

Bytes per parameter of the host store (``horizon_ray.engine.store.HostStore``), every unit alike,
c = bytes of the compute dtype (2 for bfloat16, 4 for float32):

| mode          | compute  | master          | m + v | grads                 | wire       | total | engine  |
|---------------|----------|-----------------|-------|-----------------------|------------|-------|---------|
| exact         | bfloat16 | 4               | 8     | 0 (they use the wire) | 2          | 14    | yes     |
| exact         | float32  | 4 (is the wire) | 8     | 4                     | 0          | 16    | yes     |
| bf16-weights  | bfloat16 | 2 (is the wire) | 8     | 2                     | 0          | 12    | not yet |
| bf16-state    | bfloat16 | 2 (is the wire) | 4     | 2                     | 0          | 8     | yes     |
| lora, base    | any      | 0               | 0     | 0                     | c (frozen) | c     | yes     |
| lora, adapter | any      | 4 (is the wire) | 8     | 4                     | 0          | 16    | yes     |

"wire" is the copy in the compute dtype that crosses PCIe; on CUDA it and the gradient buffers are pinned.
In exact with bf16 compute one bf16 buffer per unit is both: the wire copy of the weights, and between the
unit's backward (its last reader in a step) and its update, the unit's gradient; the update reads the
gradient chunk by chunk and writes the new wire chunk over it.

In lora (``EngineConfig(lora=...)``) the base units are the frozen wire alone (HostStore with
``adapter_layouts``: no master, moments or gradient), and each layer has one fp32 adapter unit with A [r, in]
and B [out, r] per target; on CUDA the adapters and their gradients are also resident on the device.

The host update moves, per parameter, the gradient once, master and moments twice (read, write) and the
wire copy once (written from the master chunk still in cache): exact in bf16 = 2 + 24 + 2 = 28 B, the
traffic of the fused AdamW measured on the H200 box (``node.Ceilings``).
"""

from __future__ import annotations

from dataclasses import dataclass

from horizon_ray.engine.model import DTYPE_BYTES
from horizon_ray.errors import BadInput


@dataclass(frozen=True)
class ParamBytes:
    """Host bytes per parameter of one kind of parameter (a layer's, an end unit's, an adapter's)."""

    master: int  # authoritative weights
    moments: int  # AdamW m + v
    grads: int  # separate gradient buffer (0 when gradients land in the wire buffer, or not trained)
    wire: int  # separate streamed copy in the compute dtype (0 when the master is the wire)
    master_is_wire: bool  # the master itself crosses PCIe (and is pinned on CUDA)
    trained: bool = True

    @property
    def total(self) -> int:
        return self.master + self.moments + self.grads + self.wire

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient as it arrives from the device (in its own buffer or in the wire)."""
        return (self.grads or self.wire) if self.trained else 0

    @property
    def optimizer_bytes(self) -> int:
        """Bytes the update moves per parameter: gradient in, master and moments read and written, the
        new wire copy out."""
        if not self.trained:
            return 0
        return self.grad_bytes + 2 * (self.master + self.moments) + self.wire

    @property
    def widens(self) -> bool:
        """The gradient's dtype differs from the master's: the update widens it through a scratch chunk."""
        return self.trained and self.grad_bytes != self.master


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    method: str  # "full" | "lora"
    summary: str  # one line: what it keeps
    gives_up: str  # what it costs against exact AdamW ("nothing" for the exact modes)
    short: str  # the same in a few words, for lists of alternatives
    engine_supported: bool  # horizon_ray.engine implements it today
    exact_adamw: bool  # keeps torch.optim.AdamW semantics on every trained weight
    needs_bf16: bool  # only defined for compute_dtype bfloat16

    def base(self, compute_dtype: str) -> ParamBytes:
        """Bytes per parameter of the model's own weights (every unit: embedding, layers, head)."""
        c = DTYPE_BYTES[compute_dtype]
        n = self.name
        if n == "exact":
            # fp32 compute: the master is the wire; bf16: the gradient lands in the wire buffer
            return ParamBytes(4, 8, 4, 0, True) if c == 4 else ParamBytes(4, 8, 0, c, False)
        if n == "bf16-weights":
            return ParamBytes(2, 8, 2, 0, True)
        if n == "bf16-state":
            return ParamBytes(2, 4, 2, 0, True)
        if n == "lora":
            return ParamBytes(0, 0, 0, c, False, trained=False)
        raise AssertionError(n)

    def adapter(self) -> ParamBytes:
        """Bytes per LoRA adapter parameter: fp32 master (it crosses as is and is cast on the device),
        fp32 m, v and an fp32 gradient."""
        return ParamBytes(4, 8, 4, 0, True)


MODES: dict[str, PrecisionMode] = {m.name: m for m in [
    PrecisionMode(
        "exact", "full",
        "fp32 master + fp32 AdamW m, v + one bf16 buffer that is the streamed copy and, between a unit's "
        "backward and its update, its gradient (14 B/param; 16 with fp32 compute)",
        "nothing: torch.optim.AdamW semantics with exact global-norm clipping",
        "exact AdamW",
        engine_supported=True, exact_adamw=True, needs_bf16=False),
    PrecisionMode(
        "bf16-weights", "full",
        "bf16 weights (the only copy) + fp32 AdamW m, v + bf16 gradients: the Horizon-LM paper's layout "
        "(12 B/param)",
        "the fp32 master: a weight's update smaller than half a bf16 ulp (2^-9..2^-8 of |w|) is rounded "
        "away; not implemented by the engine",
        "gives up the fp32 master: sub-ulp updates are lost",
        engine_supported=False, exact_adamw=False, needs_bf16=True),
    PrecisionMode(
        "bf16-state", "full",
        "bf16 master (it is the streamed copy) + bf16 AdamW m, v + bf16 gradients (8 B/param)",
        "the fp32 master and fp32 moments: an update smaller than half a bf16 ulp of its weight "
        "(2^-9..2^-8 of |w|, e.g. 4e-5 for |w|=0.02, more than a 1e-5 learning rate moves it) is "
        "rounded away and m, v keep 8 significant bits, so long low-learning-rate fine-tunes drift "
        "from exact AdamW",
        "gives up the fp32 master and moments: sub-ulp updates are lost, long low-LR runs drift",
        engine_supported=True, exact_adamw=False, needs_bf16=True),
    PrecisionMode(
        "lora", "lora",
        "frozen base in the compute dtype on the host (2 B/param in bf16, streamed) + LoRA adapters with "
        "fp32 master, m, v and gradient (16 B per adapter param)",
        "full fine-tuning: only the rank-r adapters train (exact fp32 AdamW on them) and the base stays "
        "frozen, so the result is an adapter and its quality is LoRA's",
        "gives up full fine-tuning: only rank-r adapters train",
        engine_supported=True, exact_adamw=False, needs_bf16=False),
]}

# Order in which a verdict suggests other modes: the closest to exact AdamW first.
FIDELITY_ORDER = ("exact", "bf16-weights", "bf16-state", "lora")


def get_mode(name: str) -> PrecisionMode:
    if name not in MODES:
        raise BadInput(f"unknown precision mode {name!r}; known modes: {', '.join(MODES)}")
    return MODES[name]
