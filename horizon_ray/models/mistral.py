"""Mistral: Llama with a sliding window on every layer, when the config sets one."""

from __future__ import annotations

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import Attention, DenseMLP, Layer
from horizon_ray.models.config import ModelConfig


def sliding_everywhere(hf: dict, qkv_bias: bool = False, o_bias: bool = False,
                       fused_qkv: bool = False) -> tuple[list[Attention], int | None]:
    """(each layer's attention, the window) of the families that slide on every layer (Mistral, Mixtral, Phi-3)."""
    _, heads, kv_heads, head_dim, layers = read.geometry(hf)
    types, window = read.window(hf, read.layer_types(hf, layers, ("sliding_attention",) * layers))
    return [Attention(heads, kv_heads, head_dim, kind=t, qkv_bias=qkv_bias, o_bias=o_bias, fused_qkv=fused_qkv)
            for t in types], window


def from_hf(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    attn, window = sliding_everywhere(hf, qkv_bias=bias, o_bias=bias)
    mlp = DenseMLP(int(hf["intermediate_size"]), read.silu(hf))
    return read.model_config(hf, "mistral", [Layer(a, mlp) for a in attn], rope=read.rope(hf), sliding_window=window)
