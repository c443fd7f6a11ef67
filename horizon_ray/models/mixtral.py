"""Mixtral: Mistral's attention (no biases whatever the config says) with a mixture of experts in place of the
MLP (``block_sparse_moe``, experts w1 / w3 / w2), top-k always renormalised, the routing weights applied in
fp32."""

from __future__ import annotations

from horizon_ray.models import hf as read
from horizon_ray.models.blocks import Layer, MoE
from horizon_ray.models.config import ModelConfig
from horizon_ray.models.mistral import sliding_everywhere


def from_hf(hf: dict) -> ModelConfig:
    read.silu(hf)
    attn, window = sliding_everywhere(hf)
    experts = int(hf.get("num_local_experts", 8))
    moe = MoE(experts, read.top_k(hf, experts, 2), int(hf["intermediate_size"]), norm_topk_prob=True,
              module="block_sparse_moe", expert_names=("w1", "w3", "w2"), fp32_combine=True)
    return read.model_config(hf, "mixtral", [Layer(a, moe) for a in attn], rope=read.rope(hf), sliding_window=window,
                             router_aux=read.router_aux_coef(hf, 0.001))
