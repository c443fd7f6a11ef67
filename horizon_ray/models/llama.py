"""Llama (Llama 3's RoPE scaling included; ``attention_bias`` gives q/k/v and o biases): the decoder the other
families vary. Every layer full attention with RoPE, a SwiGLU MLP."""

from __future__ import annotations

from dataclasses import replace

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import Attention, DenseMLP, Layer
from horizon_ray.models.config import ModelConfig


def from_hf(hf: dict) -> ModelConfig:
    _, heads, kv_heads, head_dim, layers = read.geometry(hf)
    types = read.layer_types(hf, layers, ("full_attention",) * layers, slides=False)
    bias = bool(hf.get("attention_bias", False))
    attn = Attention(heads, kv_heads, head_dim, qkv_bias=bias, o_bias=bias)
    mlp = DenseMLP(int(hf["intermediate_size"]), read.silu(hf))
    return read.model_config(hf, "llama", [Layer(replace(attn, kind=t), mlp) for t in types], rope=read.rope(hf))
