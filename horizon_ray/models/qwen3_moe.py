"""Qwen3-MoE: Qwen3's attention, a mixture of experts on the layers ``mlp_only_layers`` and
``decoder_sparse_step`` make sparse (a dense SwiGLU MLP on the others)."""

from __future__ import annotations

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import DenseMLP, Layer, MoE
from horizon_ray.models.config import ModelConfig
from horizon_ray.models.qwen3 import attention


def from_hf(hf: dict) -> ModelConfig:
    act = read.silu(hf)
    attn, window = attention(hf)
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 128)
    moe = MoE(experts, read.top_k(hf, experts, 8), int(hf.get("moe_intermediate_size", 768)),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    dense = DenseMLP(int(hf["intermediate_size"]), act)
    sparse = read.sparse_layers(hf, len(attn))
    return read.model_config(hf, "qwen3_moe", [Layer(a, moe if s else dense) for a, s in zip(attn, sparse)],
                             rope=read.rope(hf), sliding_window=window, router_aux=read.router_aux_coef(hf, 0.001))
