"""Phi-3 / Phi-4: q/k/v fused in ``qkv_proj`` and gate/up in ``gate_up_proj`` (on disk and in the unit), a
sliding window on every layer when set; no attention biases whatever the config says (HF ignores the field)."""

from __future__ import annotations

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import DenseMLP, Layer
from horizon_ray.models.config import ModelConfig
from horizon_ray.models.mistral import sliding_everywhere


def from_hf(hf: dict) -> ModelConfig:
    attn, window = sliding_everywhere(hf, fused_qkv=True)
    mlp = DenseMLP(int(hf["intermediate_size"]), read.silu(hf), fused_gate_up=True)
    return read.model_config(hf, "phi3", [Layer(a, mlp) for a in attn], rope=read.rope(hf), sliding_window=window)
