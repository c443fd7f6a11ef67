"""The stateless layer template: pure functions over weight views, no nn.Module, no kept graph.

Each function computes exactly what HF transformers' Llama / Qwen2 / Mistral modules compute (RMSNorm in
float32, RoPE from float32 frequencies, SDPA with grouped-query attention, SwiGLU), so the engine's
numerics can be pinned against them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from horizon_ray.engine.model import ModelConfig


@dataclass
class MicroBatch:
    """One micro-batch on the compute device, with everything the layers need precomputed once."""

    input_ids_host: torch.Tensor  # the same ids on the host (the embedding may be gathered there)
    input_ids_BT: torch.Tensor
    targets_BT: torch.Tensor  # next-token targets (labels shifted left by one), -100 where ignored
    cos_BTd: torch.Tensor  # RoPE tables in the compute dtype
    sin_BTd: torch.Tensor
    mask_B1TT: torch.Tensor | None  # bool, True = may attend; None = plain causal
    n_targets: int  # count of targets != -100


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_llama3 is None:
        return inv
    # Llama 3 frequency rescaling: long wavelengths slowed by `factor`, short kept, a smooth ramp between.
    s = cfg.rope_llama3
    old_len = s["original_max_position_embeddings"]
    low_wavelen = old_len / s["low_freq_factor"]
    high_wavelen = old_len / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s["factor"], inv)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, position_ids_BT: torch.Tensor, dtype: torch.dtype):
    freqs = position_ids_BT[:, :, None].float() * inv_freq.to(position_ids_BT.device)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def attention_mask(position_ids_BT: torch.Tensor | None, T: int, sliding_window: int | None, device):
    """Bool mask [B, 1, T, T], or None when plain causal attention is exactly right.

    Packed rows: a document starts wherever position_ids == 0, and no token attends across documents.
    """
    window = sliding_window is not None and T > sliding_window
    packed = position_ids_BT is not None and bool((position_ids_BT[:, 1:] == 0).any())
    if not (window or packed):
        return None
    q = torch.arange(T, device=device)
    mask = (q[None, :] <= q[:, None])[None]  # [1, T, T] causal
    if window:
        mask = mask & (q[:, None] - q[None, :] < sliding_window)[None]
    if packed:
        doc_BT = torch.cumsum((position_ids_BT == 0).long(), dim=1)
        mask = mask & (doc_BT[:, :, None] == doc_BT[:, None, :])
    return mask[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _linear(x, w, b=None):
    return F.linear(x, w, b)


def decoder_layer(x_BTD: torch.Tensor, w: dict, mb: MicroBatch, cfg: ModelConfig) -> torch.Tensor:
    B, T, D = x_BTD.shape
    hd = cfg.head_dim
    h = rms_norm(x_BTD, w["ln1"], cfg.rms_norm_eps)
    q = _linear(h, w["q"], w.get("q_b")).view(B, T, cfg.num_heads, hd).transpose(1, 2)
    k = _linear(h, w["k"], w.get("k_b")).view(B, T, cfg.num_kv_heads, hd).transpose(1, 2)
    v = _linear(h, w["v"], w.get("v_b")).view(B, T, cfg.num_kv_heads, hd).transpose(1, 2)
    cos, sin = mb.cos_BTd[:, None], mb.sin_BTd[:, None]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    # grouped-query attention without materialising repeated k/v heads
    gqa = cfg.num_kv_heads != cfg.num_heads
    if mb.mask_B1TT is None:
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5, enable_gqa=gqa)
    else:
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mb.mask_B1TT, scale=hd**-0.5, enable_gqa=gqa)
    attn = attn.transpose(1, 2).reshape(B, T, cfg.q_dim)
    x_BTD = x_BTD + _linear(attn, w["o"], w.get("o_b"))
    h = rms_norm(x_BTD, w["ln2"], cfg.rms_norm_eps)
    return x_BTD + _linear(F.silu(_linear(h, w["gate"])) * _linear(h, w["up"]), w["down"])


def head_loss_chunk(h_ND: torch.Tensor, norm_w: torch.Tensor, lm_w: torch.Tensor, targets_N: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """Summed cross-entropy of one chunk of tokens: final norm, LM head, CE in float32 (as HF does)."""
    logits = F.linear(rms_norm(h_ND, norm_w, eps), lm_w).float()
    return F.cross_entropy(logits, targets_N, ignore_index=-100, reduction="sum")
