"""OLMoE: RMSNorm of q and k over the whole projection, a mixture of experts on every layer (top-k not
renormalised unless norm_topk_prob)."""

from __future__ import annotations

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import Attention, Layer, MoE
from horizon_ray.models.config import ModelConfig


def from_hf(hf: dict) -> ModelConfig:
    read.silu(hf)
    _, heads, kv_heads, head_dim, layers = read.geometry(hf)
    types = read.layer_types(hf, layers, ("full_attention",) * layers, slides=False)
    bias = bool(hf.get("attention_bias", False))
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 64)
    moe = MoE(experts, read.top_k(hf, experts, 8), int(hf["intermediate_size"]),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    layers_ = [Layer(Attention(heads, kv_heads, head_dim, kind=t, qkv_bias=bias, o_bias=bias, qk_norm="proj"), moe)
               for t in types]
    return read.model_config(hf, "olmoe", layers_, rope=read.rope(hf), router_aux=read.router_aux_coef(hf, 0.01))
