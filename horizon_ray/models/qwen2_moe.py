"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases as ``qkv_bias`` says), a mixture of
experts plus a shared expert that every token passes through, scaled by sigmoid(x w) of its own gate, on the
layers ``mlp_only_layers`` and ``decoder_sparse_step`` make sparse (a dense SwiGLU MLP on the others)."""

from __future__ import annotations

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import DenseMLP, Layer, MoE
from horizon_ray.models.config import ModelConfig
from horizon_ray.models.qwen2 import attention


def from_hf(hf: dict) -> ModelConfig:
    act = read.silu(hf)
    attn = attention(hf, qkv_bias=bool(hf.get("qkv_bias", True)))
    experts = int(hf.get("num_experts", 60))
    shared = DenseMLP(int(hf.get("shared_expert_intermediate_size", 5632)), act, module="mlp.shared_expert",
                      key="shared.")
    moe = MoE(experts, read.top_k(hf, experts, 4), int(hf.get("moe_intermediate_size", 1408)),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)), shared=shared)
    dense = DenseMLP(int(hf["intermediate_size"]), act)
    sparse = read.sparse_layers(hf, len(attn))
    return read.model_config(hf, "qwen2_moe", [Layer(a, moe if s else dense) for a, s in zip(attn, sparse)],
                             rope=read.rope(hf), router_aux=read.router_aux_coef(hf, 0.001))
