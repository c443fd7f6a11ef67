"""The stateless layer template: pure functions over weight views, no nn.Module, no kept graph.

Each function computes exactly what HF transformers' Llama / Qwen2 / Mistral modules compute (RMSNorm in
float32, RoPE from float32 frequencies, SDPA with grouped-query attention, SwiGLU), so the engine's
numerics can be pinned against them.

With LoRA the weights of a layer also hold its adapters ("q.lora_A" [r, in], "q.lora_B" [out, r], ...), and
every adapted projection computes PEFT's ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: the adapter
path in the compute dtype, the fp32 adapters cast to it for the matmuls (what PEFT does under autocast with
fp32 adapters on a bf16 base; in fp32 it is plain fp32), added to the base output. One autograd function
does the adapter part (``_LoraAdd``): for its backward it keeps only the input x, which the base projection
keeps anyway, and the [tokens, r] intermediate; the dropout mask is rebuilt in the backward from its seed, so
an adapter adds no activation memory of the input's size and no widened copy of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from horizon_ray.engine.kernels import Kernels, accumulate_mm, linear
from horizon_ray.engine.lora import mix_seed
from horizon_ray.engine.model import LEAF_KEYS, ModelConfig


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


@dataclass(frozen=True)
class LoraCall:
    """How one call of the layer template applies the adapters found in its weights."""

    scaling: float  # alpha / r
    dropout: float  # probability of dropping an adapter input element; 0 in evaluation
    # Seeds the call's dropout masks (one per adapted projection, each from this seed and the projection):
    # the same seed gives the same masks in the forward, the recompute and the backward of a step.
    seed: int = 0


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


_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def _adapter_input(x: torch.Tensor, dtype: torch.dtype, dropout: float, seed: int) -> torch.Tensor:
    """dropout(x) in the adapters' dtype; the mask is a function of the seed alone."""
    x = x.to(dtype)
    if dropout == 0:
        return x
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    keep = torch.empty(x.shape, dtype=dtype, device=x.device).bernoulli_(1.0 - dropout, generator=gen)
    return x * keep.div_(1.0 - dropout)


class _LoraAdd(torch.autograd.Function):
    """y + (dropout(x) A^T) B^T * scaling in y's dtype (the compute dtype): the fp32 adapters are cast to it for
    the matmuls, as PEFT's adapters are under autocast, and their gradients come back in fp32. No activation
    of the input's or output's size is ever widened: the backward scales the [tokens, r] products, not the
    incoming gradient."""

    @staticmethod
    def forward(ctx, x, y, a, b, scaling: float, dropout: float, seed: int):
        dt = y.dtype
        u = F.linear(_adapter_input(x, dt, dropout, seed), a.to(dt))  # [..., r]
        ctx.save_for_backward(x, a, b, u)
        ctx.lora = (scaling, dropout, seed)
        return torch.add(y, F.linear(u, b.to(dt)), alpha=scaling)

    @staticmethod
    def backward(ctx, grad):
        x, a, b, u = ctx.saved_tensors
        scaling, dropout, seed = ctx.lora
        need_x, need_y, need_a, need_b = ctx.needs_input_grad[:4]
        dt, r = grad.dtype, a.shape[0]
        grad_b = (grad.reshape(-1, grad.shape[-1]).T @ u.reshape(-1, r)).float().mul_(scaling) if need_b else None
        gu = (grad @ b.to(dt)).mul_(scaling)  # dL/du, [..., r]
        grad_a = grad_x = None
        if need_a:
            x_d = _adapter_input(x, dt, dropout, seed)  # rebuilt: the forward kept only x (x itself at p = 0)
            grad_a = (gu.reshape(-1, r).T @ x_d.reshape(-1, x_d.shape[-1])).float()
            del x_d
        if need_x:
            grad_x = gu @ a.to(dt)
            if dropout > 0:  # through the same mask: dropout of a tensor of ones is keep / (1 - p)
                grad_x = grad_x * _adapter_input(torch.ones_like(grad_x), dt, dropout, seed)
        return grad_x, grad if need_y else None, grad_a, grad_b, None, None, None


def _lora_add(x: torch.Tensor, y: torch.Tensor, w: dict, key: str, lora: LoraCall | None) -> torch.Tensor:
    """y plus projection ``key``'s adapter applied to x, when the layer has one."""
    a = w.get(key + ".lora_A")
    if a is None:
        return y
    # each projection draws its own dropout mask (as PEFT's per-module dropout does)
    seed = mix_seed(lora.seed, _PROJECTIONS.index(key)) if lora.dropout > 0 else 0
    return _LoraAdd.apply(x, y, a, w[key + ".lora_B"], lora.scaling, lora.dropout, seed)


class Template:
    """The decoder layer and the LM head of one model, as pure functions of weight views.

    ``layer`` computes what HF's decoder layer computes. With ``sinks`` (the fp32 gradient accumulators of
    the unit's weights, by the same keys) every projection's weight gradient is added there by the
    backward; the other weights of the unit (the norms) are the autograd leaves that ``leaf_keys`` names.
    A unit's fused keys (``qkv``, ``gate_up``: members adjacent in its flat buffer) run as one GEMM.
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        self.cfg = cfg
        self.ops = kernels or Kernels()

    @staticmethod
    def leaf_keys(w: dict) -> list[str]:
        """Keys of a layer's weights whose gradient autograd returns (the rest go to sinks)."""
        return [k for k in w if k in LEAF_KEYS]

    def _proj(self, x, w, key, lora, sinks):
        sink = sinks or {}
        y = linear(x, w[key], w.get(key + "_b"), sink.get(key), sink.get(key + "_b"))
        return _lora_add(x, y, w, key, lora)

    def layer(self, x_BTD: torch.Tensor, w: dict, mb: MicroBatch, lora: LoraCall | None = None,
              sinks: dict | None = None) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        B, T, D = x_BTD.shape
        hd = cfg.head_dim
        h = ops.rms_norm(x_BTD, w["ln1"], cfg.rms_norm_eps)
        if "qkv" in w:
            q, k, v = self._proj(h, w, "qkv", lora, sinks).split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
        else:
            q, k, v = (self._proj(h, w, key, lora, sinks) for key in ("q", "k", "v"))
        q = q.view(B, T, cfg.num_heads, hd).transpose(1, 2)
        k = k.view(B, T, cfg.num_kv_heads, hd).transpose(1, 2)
        v = v.view(B, T, cfg.num_kv_heads, hd).transpose(1, 2)
        q, k = ops.rope(q, k, mb.cos_BTd, mb.sin_BTd)
        # grouped-query attention without materialising repeated k/v heads
        attn = ops.attention(q, k, v, mb.mask_B1TT, hd**-0.5).transpose(1, 2).reshape(B, T, cfg.q_dim)
        x_BTD = x_BTD + self._proj(attn, w, "o", lora, sinks)
        h = ops.rms_norm(x_BTD, w["ln2"], cfg.rms_norm_eps)
        if "gate_up" in w:
            mlp = ops.swiglu(self._proj(h, w, "gate_up", lora, sinks))
        else:
            mlp = F.silu(self._proj(h, w, "gate", lora, sinks)) * self._proj(h, w, "up", lora, sinks)
        return x_BTD + self._proj(mlp, w, "down", lora, sinks)

    def final_norm(self, h: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(h, norm_w, self.cfg.rms_norm_eps)

    def head_loss(self, h_ND: torch.Tensor, w: dict, targets_N: torch.Tensor, scale: float, chunk: int,
                  sinks: dict | None = None, need_dh: bool = False):
        """scale x the summed cross-entropy of these tokens (float32 scalar) through the final norm and the LM
        head, in chunks of tokens so that full logits never exist. Training (``need_dh`` or ``sinks``): also
        dL/dh (or None), with the LM head's gradient added into ``sinks["lm_head"]`` and the final norm's into
        ``sinks["norm"]``, for whichever of the two the sinks hold."""
        sinks = sinks or {}
        train = need_dh or bool(sinks)
        norm_w, lm_w = w["norm"], w["lm_head"]
        if not train:
            hn = self.final_norm(h_ND, norm_w)
            total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
            for lo in range(0, hn.shape[0], chunk):
                total += self.ops.cross_entropy_(F.linear(hn[lo:lo + chunk], lm_w), targets_N[lo:lo + chunk], scale,
                                                 grad=False)
            return total, None
        h_leaf = h_ND.detach().requires_grad_(need_dh)
        norm_leaf = norm_w.detach().requires_grad_("norm" in sinks)
        with torch.enable_grad():
            hn = self.final_norm(h_leaf, norm_leaf)
        hn_d = hn.detach()
        d_hn = torch.empty_like(hn_d)
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for lo in range(0, hn_d.shape[0], chunk):
            hi = min(lo + chunk, hn_d.shape[0])
            logits = F.linear(hn_d[lo:hi], lm_w)
            total += self.ops.cross_entropy_(logits, targets_N[lo:hi], scale, grad=True)
            # the logits now hold dL/dlogits: back through the LM head's matmul
            torch.mm(logits, lm_w, out=d_hn[lo:hi])
            if "lm_head" in sinks:
                accumulate_mm(sinks["lm_head"], logits.t(), hn_d[lo:hi])
        wanted = [t for t in (h_leaf, norm_leaf) if t.requires_grad]
        grads = dict(zip([id(t) for t in wanted], torch.autograd.grad(hn, wanted, d_hn)))
        if norm_leaf.requires_grad:
            sinks["norm"].add_(grads[id(norm_leaf)])
        return total, grads.get(id(h_leaf))
