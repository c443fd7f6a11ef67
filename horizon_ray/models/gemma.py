"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorm computed in fp32, norms before and after attention and the MLP, a
GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), the softmax scale from ``query_pre_attn_scalar``, tied
embeddings by default, alternating sliding-window and global layers. Gemma 2 soft-caps attention scores and the
final logits; Gemma 3 norms q and k per head, gives each layer type its own RoPE base and caps the final logits
where set."""

from __future__ import annotations

from horizon_ray.errors import BadInput
from horizon_ray.models import hf as read
from horizon_ray.models.blocks import Attention, DenseMLP, Layer
from horizon_ray.models.config import ModelConfig


def _activation(hf: dict) -> str:
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"  # Gemma reads hidden_activation, not hidden_act
    if act != "gelu_pytorch_tanh":
        raise BadInput(f"config field hidden_activation={act!r}: Gemma's MLP is supported with "
                       "'gelu_pytorch_tanh' only")
    return "gelu_tanh"


def _rope3(hf: dict) -> tuple[dict, float]:
    """Gemma 3's (global layers' RoPE, sliding layers' base): the v5 config's rope_parameters by layer type, or
    rope_theta / rope_scaling for the global layers and rope_local_base_freq for the sliding ones."""
    params = dict(hf.get("rope_parameters") or {})
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    glob, loc = read.rope_entry(full, "rope of the global layers"), read.rope_entry(local, "rope of the sliding layers")
    if loc["llama3"] is not None or loc["linear"] != 1.0:
        raise BadInput("rope of the sliding layers: only plain RoPE ('default') is supported there")
    return glob, loc["theta"]


def _gemma(hf: dict, arch: str) -> ModelConfig:
    act = _activation(hf)
    _, heads, kv_heads, head_dim, layers = read.geometry(hf)
    if arch == "gemma2":  # even layers slide
        every, rope, local_theta = 2, read.rope(hf), None
        attn_cap, final_cap = hf.get("attn_logit_softcapping", 50.0), hf.get("final_logit_softcapping", 30.0)
    else:  # five sliding layers, then a global one
        every, (rope, local_theta) = int(hf.get("sliding_window_pattern") or 6), _rope3(hf)
        if hf.get("attn_logit_softcapping") is not None:
            raise BadInput(f"config field attn_logit_softcapping={hf['attn_logit_softcapping']!r}: Gemma 3 does "
                           "not cap attention scores (transformers ignores the field); set it to null")
        attn_cap, final_cap = None, hf.get("final_logit_softcapping")
    default = tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers))
    types, window = read.window(hf, read.layer_types(hf, layers, default), default=4096)
    bias = bool(hf.get("attention_bias", False))
    mlp = DenseMLP(int(hf["intermediate_size"]), act)
    attn = [Attention(heads, kv_heads, head_dim, kind=t, qkv_bias=bias, o_bias=bias,
                      qk_norm="head" if arch == "gemma3_text" else None, softcap=float(attn_cap) if attn_cap else None)
            for t in types]
    return read.model_config(
        hf, arch, [Layer(a, mlp, sandwich_norms=True) for a in attn], rope=rope, tie_default=True,
        sliding_window=window, local_rope_theta=local_theta, norm_offset=1.0, hidden_act=act, embed_scale=True,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_softcap=float(final_cap) if final_cap else None)


def gemma2(hf: dict) -> ModelConfig:
    return _gemma(hf, "gemma2")


def gemma3_text(hf: dict) -> ModelConfig:
    return _gemma(hf, "gemma3_text")
