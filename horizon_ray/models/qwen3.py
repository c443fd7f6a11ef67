"""Qwen3: RMSNorm of each head of q and k before RoPE, an explicit head_dim; sliding-window layers from
max_window_layers on, only when use_sliding_window (HF drops the window otherwise)."""

from __future__ import annotations

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import Attention, DenseMLP, Layer
from horizon_ray.models.config import ModelConfig


def attention(hf: dict) -> tuple[list[Attention], int | None]:
    """(each layer's attention, the window) in Qwen3 and Qwen3-MoE."""
    _, heads, kv_heads, head_dim, layers = read.geometry(hf)
    first = int(hf.get("max_window_layers") or layers) if hf.get("use_sliding_window") else layers
    default = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    types = read.layer_types(hf, layers, default)
    if hf.get("use_sliding_window"):
        types, window = read.window(hf, types, default=4096)
    else:
        types, window = ("full_attention",) * layers, None
    bias = bool(hf.get("attention_bias", False))
    return [Attention(heads, kv_heads, head_dim, kind=t, qkv_bias=bias, o_bias=bias, qk_norm="head")
            for t in types], window


def from_hf(hf: dict) -> ModelConfig:
    attn, window = attention(hf)
    mlp = DenseMLP(int(hf["intermediate_size"]), read.silu(hf))
    return read.model_config(hf, "qwen3", [Layer(a, mlp) for a in attn], rope=read.rope(hf), sliding_window=window)
