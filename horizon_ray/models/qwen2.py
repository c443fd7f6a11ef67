"""Qwen2 / Qwen2.5: Llama with q/k/v biases (no output bias). Sliding-window attention (use_sliding_window) is
refused."""

from __future__ import annotations

from horizon_ray.errors import BadInput
from horizon_ray.models import hf as read
from horizon_ray.models.blocks import Attention, DenseMLP, Layer
from horizon_ray.models.config import ModelConfig


def attention(hf: dict, qkv_bias: bool = True) -> list[Attention]:
    """Each layer's attention in Qwen2 and Qwen2-MoE: full, q/k/v biases."""
    if hf.get("use_sliding_window"):
        raise BadInput("config field use_sliding_window=True: Qwen2 sliding-window attention is not supported")
    _, heads, kv_heads, head_dim, layers = read.geometry(hf)
    types = read.layer_types(hf, layers, ("full_attention",) * layers, slides=False)
    return [Attention(heads, kv_heads, head_dim, kind=t, qkv_bias=qkv_bias) for t in types]


def from_hf(hf: dict) -> ModelConfig:
    mlp = DenseMLP(int(hf["intermediate_size"]), read.silu(hf))
    return read.model_config(hf, "qwen2", [Layer(a, mlp) for a in attention(hf)], rope=read.rope(hf))
