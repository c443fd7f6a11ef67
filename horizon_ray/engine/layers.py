"""The stateless layer template: pure functions over weight views, no nn.Module, no kept graph.

Each function computes exactly what HF transformers' modules of the model's family compute (model.py lists
the families: RMSNorm in float32, RoPE from float32 frequencies, SDPA with grouped-query attention, SwiGLU;
Qwen3's q/k norms; Phi-3's fused projections; Gemma's (1 + w) norms around attention and the MLP, GELU-tanh,
scaled embeddings, soft-capped attention scores and logits, sliding and global layers with their own RoPE;
a mixture of experts in place of the MLP), so the engine's numerics can be pinned against them.

Layers of one model may differ: a Gemma layer is a sliding-window or a global one, and the bottom layer
scales the embeddings (so that its backward carries the factor into the embedding's gradient). ``layer``
takes the layer's index ``j`` for that.

A mixture-of-experts layer routes each token to its top-k experts (the router's softmax in fp32, HF's
top-k and renormalisation), sorts the token copies by expert and runs each expert once over its tokens
(kernels.expert_linear), then sums each token's k outputs weighted by the router. When the config asks for
the router's load-balancing loss, each micro-batch's routing statistics are kept during the forward
(``RouterStats``), the loss of the step is computed from them once the forward is done
(``Template.router_loss``), and each layer's backward adds its gradient through the router's softmax.

With LoRA the weights of a layer also hold its adapters ("q.lora_A" [r, in], "q.lora_B" [out, r], ...), and
every adapted projection computes PEFT's ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: the adapter
path in the compute dtype, the fp32 adapters cast to it for the matmuls (what PEFT does under autocast with
fp32 adapters on a bf16 base; in fp32 it is plain fp32), added to the base output. One autograd function
runs the adapted projection (``_LoraLinear``): for its backward it keeps only the input x, which the base
projection keeps anyway, and the [tokens, r] intermediate; the dropout mask is rebuilt in the backward from its
seed, so an adapter adds no activation memory of the input's size and no widened copy of it. Adapted
projections of one input (q, k and v; gate and up) run together without dropout (``_LoraLinears``): their
adapters read that input once a pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from horizon_ray.engine.kernels import (
    Kernels,
    accumulate_mm,
    cap_logits,
    expert_linear,
    linear,
    linear_backward,
    softcap_attention,
)
from horizon_ray.engine.lora import mix_seed
from horizon_ray.engine.model import FUSED, LEAF_KEYS, ModelConfig
from horizon_ray.models.blocks import DenseMLP, Layer, MoE


class RoutingLog:
    """Every routing decision of a run's MoE layers (each token's top-k experts), in the order the layers route:
    recorded by one run (``RoutingLog()``), replayed by another (``RoutingLog(replay=recorded)``), so that two
    runs of different precision or on different devices route every token alike and differ by roundoff alone.

    A near tie between two experts flips with the last bits of the router's logits, and a flip is discrete:
    no tolerance holds it. HF's own Mixtral + PEFT, bf16 against fp32 on the same weights, gives first adapter
    gradients 0.22-0.25 apart through such flips (0.07 with one expert, no routing). Replayed, a token's router
    weights are still the run's own: its softmax at the recorded experts, so their gradient is the run's too.
    The recording copies each decision to the host (a sync per MoE layer): for comparisons, not for speed."""

    def __init__(self, replay: RoutingLog | None = None):
        self.calls: list[torch.Tensor] = []
        self._replay = None if replay is None else replay.calls
        self._next = 0

    def top_k(self, probs_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [N, k] of this routing: the top k of ``probs_NE``, or the recorded run's experts."""
        if self._replay is None:
            top_w, top_e = torch.topk(probs_NE, k, dim=-1)
            self.calls.append(top_e.cpu())
            return top_w, top_e
        if self._next == len(self._replay):
            raise RuntimeError(f"the replayed run routed {len(self._replay)} times; this one routes more: the two "
                               "runs must split their steps alike (micro-batches, row groups, steps)")
        top_e = self._replay[self._next]
        self._next += 1
        if top_e.shape != (probs_NE.shape[0], k):
            raise RuntimeError(f"routing {self._next} of the replayed run chose {tuple(top_e.shape)} experts, this "
                               f"one routes {probs_NE.shape[0]} tokens to {k}: the runs must split alike")
        top_e = top_e.to(probs_NE.device)
        return probs_NE.gather(-1, top_e), top_e


@dataclass
class RouterStats:
    """The routing of one row group of a micro-batch through every MoE layer, for the load-balancing loss."""

    group: int  # the micro-batch of the step it belongs to (its row groups share one loss term)
    tokens: int  # rows x sequence of this row group
    counts: dict = field(default_factory=dict)  # layer -> [E] fp32: top-k assignments per expert
    probs: dict = field(default_factory=dict)  # layer -> [E] fp32: routing probabilities summed over tokens
    # d(step loss) / d(routing probability of expert e) at every token of every layer: set after the forward
    grad_E: torch.Tensor | None = None


@dataclass
class MicroBatch:
    """One micro-batch on the compute device, with everything the layers need precomputed once."""

    input_ids_host: torch.Tensor  # the same ids on the host (the embedding may be gathered there)
    input_ids_BT: torch.Tensor
    targets_BT: torch.Tensor  # next-token targets (labels shifted left by one), -100 where ignored
    cos_BTd: torch.Tensor  # RoPE tables in the compute dtype (of the global layers, where layers differ)
    sin_BTd: torch.Tensor
    mask_B1TT: torch.Tensor | None  # bool, True = may attend; None = plain causal
    n_targets: int  # count of targets != -100
    # (cos, sin, mask) of the sliding-window layers of a model whose layers differ (Gemma, Qwen3 with a
    # window on some layers); None: every layer reads the tables above
    sliding: tuple | None = None
    router: RouterStats | None = None  # MoE with the load-balancing loss: this row group's routing
    # generation: the keys and values of earlier positions (generate.KVCache); the layer appends this call's
    # and attends to all of them, through the masks above, of shape [B, 1, T, cached + T]
    cache: KVCacheLike | None = None

    def attention_inputs(self, kind: str) -> tuple:
        """(cos, sin, mask) of a layer of this kind ("full_attention" | "sliding_attention")."""
        if kind == "sliding_attention" and self.sliding is not None:
            return self.sliding
        return self.cos_BTd, self.sin_BTd, self.mask_B1TT


class KVCacheLike(Protocol):
    def extend(self, j: int, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep layer j's keys and values of this call; those of every position so far, [B, kvH, S, d]."""
        ...


@dataclass(frozen=True)
class LoraCall:
    """How one call of the layer template applies the adapters found in its weights."""

    scaling: float  # alpha / r
    dropout: float  # probability of dropping an adapter input element; 0 in evaluation
    # Seeds the call's dropout masks (one per adapted projection, each from this seed and the projection):
    # the same seed gives the same masks in the forward, the recompute and the backward of a step.
    seed: int = 0


def inv_frequencies(cfg: ModelConfig, kind: str = "full_attention") -> torch.Tensor:
    """RoPE's inverse frequencies of a layer of this kind: the sliding layers' own base where they have one
    (Gemma 3), else the global layers' (with Llama 3's rescaling or linear interpolation, where set)."""
    d = cfg.head_dim
    if kind == "sliding_attention" and cfg.local_rope_theta is not None:
        return 1.0 / (cfg.local_rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_linear != 1.0:
        inv = inv / cfg.rope_linear
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

    Packed rows: a document starts wherever position_ids == 0, and no token attends across documents. The
    mask is built on ``device``; whether one is needed is read from ``position_ids_BT`` where it lies (the
    host's, in training: no device sync).
    """
    window = sliding_window if sliding_window is not None and T > sliding_window else None
    packed_BT = position_ids_BT if position_ids_BT is not None and bool((position_ids_BT[:, 1:] == 0).any()) else None
    if window is None and packed_BT is None:
        return None
    q = torch.arange(T, device=device)
    mask = (q[None, :] <= q[:, None])[None]  # [1, T, T] causal
    if window is not None:
        mask = mask & (q[:, None] - q[None, :] < window)[None]
    if packed_BT is not None:
        doc_BT = torch.cumsum((packed_BT.to(device, non_blocking=True) == 0).long(), dim=1)
        mask = mask & (doc_BT[:, :, None] == doc_BT[:, None, :])
    return mask[:, None]


# Adapted projections by key; a projection's index seeds its dropout masks (new keys go at the end).
_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")


def _keep_mask(shape, dtype: torch.dtype, device, dropout: float, seed: int) -> torch.Tensor:
    """Dropout's scaled mask (keep / (1 - p)), a function of the seed alone."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1.0 - dropout, generator=gen).div_(1.0 - dropout)


def _adapter_input(x: torch.Tensor, dtype: torch.dtype, dropout: float, seed: int) -> torch.Tensor:
    """dropout(x) in the adapters' dtype."""
    x = x.to(dtype)
    if dropout == 0:
        return x
    return x * _keep_mask(x.shape, dtype, x.device, dropout, seed)


class _LoraLinear(torch.autograd.Function):
    """PEFT's adapted projection on a frozen weight, F.linear(x, w, bias) + (dropout(x) A^T) B^T * scaling, in the
    compute dtype: the fp32 adapters are cast to it for the matmuls, as PEFT's adapters are under autocast, and
    their gradients come back in fp32. The adapter's products are added inside GEMMs (``addmm_``, the sum rounded
    once): its output into the frozen projection's output in the forward, its input gradient into the frozen
    projection's in the backward. Without dropout, with a checkpoint every layer, an adapter then writes or reads
    5 x in + 6 x out activation elements a token over a step (forward, recompute, backward) beyond the frozen
    projection's, where adding its products afterwards took 7 x in + 10 x out. No activation is widened: the
    backward scales the [tokens, r] products, not the incoming gradient. It keeps x, the [tokens, r] product and,
    where x needs a gradient, w."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, scaling: float, dropout: float, seed: int):
        assert not (w.requires_grad or (bias is not None and bias.requires_grad)), "the adapted weight is frozen"
        y = F.linear(x, w, bias)
        dt, r = y.dtype, a.shape[0]
        u = F.linear(_adapter_input(x, dt, dropout, seed), a.to(dt))  # [..., r]
        y.view(-1, y.shape[-1]).addmm_(u.view(-1, r), b.to(dt).t(), alpha=scaling)
        ctx.save_for_backward(x, w if ctx.needs_input_grad[0] else None, a, b, u)
        ctx.lora = (scaling, dropout, seed)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, a, b, u = ctx.saved_tensors
        scaling, dropout, seed = ctx.lora
        need_x, _, _, need_a, need_b = ctx.needs_input_grad[:5]
        dt, r = grad.dtype, a.shape[0]
        g = grad.reshape(-1, grad.shape[-1])
        grad_b = (g.T @ u.reshape(-1, r)).float().mul_(scaling) if need_b else None
        gu = (g @ b.to(dt)).mul_(scaling)  # dL/du, [tokens, r]
        grad_a = grad_x = None
        if need_a:
            x_d = _adapter_input(x, dt, dropout, seed)  # rebuilt: the forward kept only x (x itself at p = 0)
            grad_a = (gu.T @ x_d.reshape(-1, x_d.shape[-1])).float()
            del x_d
        if need_x:
            grad_x = g @ w  # the frozen projection's input gradient
            if dropout > 0:  # through the forward's mask
                mask = _keep_mask((g.shape[0], x.shape[-1]), dt, x.device, dropout, seed)
                grad_x.add_(mask.mul_(gu @ a.to(dt)))
            else:
                grad_x.addmm_(gu, a.to(dt))
            grad_x = grad_x.view(x.shape)
        return grad_x, None, None, grad_a, grad_b, None, None, None


class _LoraLinears(torch.autograd.Function):
    """Several adapted projections of one input (q, k and v; gate and up), without dropout: what ``_LoraLinear``
    computes for each, with the passes over the shared input made once. The adapters' A's are stacked, so one
    GEMM reads x for all their [tokens, r] products in the forward, one reads it for all their A gradients in the
    backward, and one adds all their input gradients; the frozen projections' input gradients are summed inside
    their GEMMs (``addmm_``) rather than by autograd. Per extra projection of the group that is 1 x in elements a
    token fewer in each forward pass and 5 x in fewer in the backward. The inputs after x and the scaling are
    (w, bias, A, B) of each projection in turn; it returns their outputs in that order."""

    @staticmethod
    def forward(ctx, x, scaling: float, *weights):
        ws, biases, a_s, b_s = weights[0::4], weights[1::4], weights[2::4], weights[3::4]
        assert not any(w.requires_grad for w in ws), "the adapted weights are frozen"
        assert not any(b is not None and b.requires_grad for b in biases), "the adapted biases are frozen"
        ys = [F.linear(x, w, bias) for w, bias in zip(ws, biases)]
        dt, r = ys[0].dtype, a_s[0].shape[0]
        a_all = torch.cat([a.to(dt) for a in a_s])  # [n r, in]
        u = F.linear(x.to(dt), a_all).view(-1, len(a_s) * r)  # every adapter's [tokens, r], side by side
        for i, (y, b) in enumerate(zip(ys, b_s)):
            y.view(-1, y.shape[-1]).addmm_(u[:, i * r:(i + 1) * r], b.to(dt).t(), alpha=scaling)
        ctx.save_for_backward(x, a_all, u, *b_s, *(ws if ctx.needs_input_grad[0] else ()))
        ctx.scaling, ctx.n = scaling, len(a_s)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        x, a_all, u, *rest = ctx.saved_tensors
        n, scaling = ctx.n, ctx.scaling
        b_s, ws = rest[:n], rest[n:]
        dt, r = grads[0].dtype, a_all.shape[0] // n
        gs = [g.reshape(-1, g.shape[-1]) for g in grads]
        need = ctx.needs_input_grad
        grad_b = [(g.T @ u[:, i * r:(i + 1) * r]).float().mul_(scaling) if need[5 + 4 * i] else None
                  for i, g in enumerate(gs)]
        gu = torch.cat([g @ b.to(dt) for g, b in zip(gs, b_s)], dim=1).mul_(scaling)  # dL/du, [tokens, n r]
        grad_a: list[torch.Tensor | None] = [None] * n
        if any(need[4 + 4 * i] for i in range(n)):
            x2 = x.reshape(-1, x.shape[-1])
            grad_a = [ga if need[4 + 4 * i] else None for i, ga in enumerate((gu.T @ x2.to(dt)).float().split(r))]
        grad_x = None
        if need[0]:
            grad_x = gs[0] @ ws[0]  # the frozen projections' input gradients, summed inside their GEMMs
            for g, w in zip(gs[1:], ws[1:]):
                grad_x.addmm_(g, w)
            grad_x = grad_x.addmm_(gu, a_all).view(x.shape)
        out: list[torch.Tensor | None] = [grad_x, None]
        for i in range(n):
            out += [None, None, grad_a[i], grad_b[i]]
        return tuple(out)


def _lora_linear(x: torch.Tensor, w: dict, key: str, lora: LoraCall | None) -> torch.Tensor:
    """Projection ``key`` of x with its adapter."""
    assert lora is not None, "weights with adapters come with their LoraCall"
    # each projection draws its own dropout mask (as PEFT's per-module dropout does)
    seed = mix_seed(lora.seed, _PROJECTIONS.index(key)) if lora.dropout > 0 else 0
    return _LoraLinear.apply(x, w[key], w.get(key + "_b"), w[key + ".lora_A"], w[key + ".lora_B"], lora.scaling,
                             lora.dropout, seed)


class _RouterAuxGrad(torch.autograd.Function):
    """The router's logits, unchanged; the backward adds the load-balancing loss's gradient: with c_e its
    derivative by the routing probability p_e, through the softmax, p_e (c_e - sum_f p_f c_f)."""

    @staticmethod
    def forward(ctx, logits_NE, c_E):
        ctx.save_for_backward(logits_NE, c_E)
        return logits_NE.clone()

    @staticmethod
    def backward(ctx, grad):
        logits, c = ctx.saved_tensors
        p = torch.softmax(logits.float(), dim=-1)
        extra = p * (c - (p * c).sum(-1, keepdim=True))
        return grad + extra.to(grad.dtype), None


def expert_counts(flat_e: torch.Tensor, E: int) -> torch.Tensor:
    """Token copies routed to each of the E experts, int64 [E], computed on the device without reading
    anything back: torch.bincount on CUDA reads its input's maximum on the host to size its output, a sync
    that stalled the stream in every MoE layer's forward and recompute."""
    return torch.zeros(E, dtype=torch.int64, device=flat_e.device).index_add_(
        0, flat_e, torch.ones_like(flat_e, dtype=torch.int64))


class _Deferred(torch.autograd.Function):
    """act W^T (+ b) left out of the forward: a zero-size stand-in (an expanded scalar) whose backward runs the
    product's two gradient GEMMs, as _SinkLinear's would. Its saved act is freed once that backward has run."""

    @staticmethod
    def forward(ctx, act, w, gw, gb, out_features: int):
        ctx.save_for_backward(act, w)
        ctx.sinks = (gw, gb)
        return act.new_zeros(()).expand(*act.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, gy):
        act, w = ctx.saved_tensors
        gw, gb = ctx.sinks
        return linear_backward(gy, act, w, gw, gb, ctx.needs_input_grad[0]), None, None, None, None


@dataclass(frozen=True)
class Deferred:
    """A decoder layer's output ``residual + act W^T (+ b)`` with its last projection not run
    (``Template.layer_for_backward``). Nothing but that sum reads the projection's product, and the sum's
    gradient is the incoming one, so the recompute of a checkpointed layer does not need the GEMM: the backward
    runs only the two GEMMs of its gradients. For a dense MLP's down projection that is a quarter of the layer's
    forward GEMM FLOPs (HF's checkpointing skips it too: its recompute stops at the last tensor the backward
    saves)."""

    residual: torch.Tensor
    act: torch.Tensor
    key: str

    def grad_pairs(self, w: dict, sinks: dict | None, dy: torch.Tensor):
        """(outputs, their gradients) for torch.autograd.grad: the residual and a stand-in for the projection,
        both with the incoming gradient. The projection's weight gradient goes to its sink, where it has one
        (full fine-tuning), and dL/d act on to what trains below it."""
        sinks = sinks or {}
        gw, gb = sinks.get(self.key), sinks.get(self.key + "_b")
        stand_in = _Deferred.apply(self.act, w[self.key], gw, gb, dy.shape[-1])
        if not stand_in.requires_grad and gw is not None:  # nothing below trains; the weight itself does
            linear_backward(dy, self.act, w[self.key], gw, gb, need_gx=False)
        pairs = [(o, dy) for o in (self.residual, stand_in) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]


class Template:
    """The decoder layer and the LM head of one model, as pure functions of weight views.

    ``layer`` computes what HF's decoder layer computes. With ``sinks`` (the fp32 gradient accumulators of
    the unit's weights, by the same keys) every projection's weight gradient is added there by the
    backward; the other weights of the unit (the norms) are the autograd leaves that ``leaf_keys`` names.
    A unit's fused keys (``qkv``, ``gate_up``: members adjacent in its flat buffer, or one tensor on disk as
    in Phi-3) run as one GEMM.
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        self.cfg = cfg
        self.ops = kernels or Kernels()
        self.inv_freq = {kind: inv_frequencies(cfg, kind) for kind in sorted(set(cfg.layer_types))}
        self._uniform = len(set(cfg.layers)) == 1 and not cfg.embed_scale
        self._inv_freq_at: dict[str, dict[str, torch.Tensor]] = {}
        self.routing: RoutingLog | None = None  # set to record or replay the MoE layers' routing (RoutingLog)

    def inv_freq_on(self, device) -> dict[str, torch.Tensor]:
        """The RoPE frequencies of each layer kind on ``device``, copied there once."""
        key = str(device)
        if key not in self._inv_freq_at:
            self._inv_freq_at[key] = {kind: f.to(device) for kind, f in self.inv_freq.items()}
        return self._inv_freq_at[key]

    @staticmethod
    def leaf_keys(w: dict) -> list[str]:
        """Keys of a layer's weights whose gradient autograd returns (the rest go to sinks)."""
        return [k for k in w if k in LEAF_KEYS]

    # ---- inputs ------------------------------------------------------------------------------------------

    def micro_batch(self, ids_BT, targets_BT, positions_BT, position_ids_BT, device, dtype,
                    router: RouterStats | None = None) -> MicroBatch:
        """A micro-batch's ids and targets on the device with the RoPE tables and masks its layers read.
        ``position_ids_BT``: the caller's (packed documents), or None; ``positions_BT``: those or 0..T-1."""
        cfg, T = self.cfg, ids_BT.shape[1]
        # The tables are built where they are read: built on the host, each row group's cos and sin (8 MB at
        # 8,192 tokens) left the GPU idle while the host computed them and then crossed as pageable copies
        # (qwen3-4b: 0.065 s of a 4.04 s step in gaps between those copies). Only the positions cross.
        positions_dev = positions_BT.to(device, non_blocking=True)

        def tables(kind: str) -> tuple:
            cos, sin = rope_tables(self.inv_freq_on(device)[kind], positions_dev, dtype)
            window = cfg.sliding_window if kind == "sliding_attention" else None
            return cos, sin, attention_mask(position_ids_BT, T, window, device)

        kinds = set(cfg.layer_types)
        main = "full_attention" if "full_attention" in kinds else "sliding_attention"
        cos, sin, mask = tables(main)
        return MicroBatch(
            input_ids_host=ids_BT,
            input_ids_BT=ids_BT.to(device, non_blocking=True),
            targets_BT=targets_BT.to(device, non_blocking=True),
            cos_BTd=cos, sin_BTd=sin, mask_B1TT=mask,
            n_targets=int((targets_BT != -100).sum()),
            sliding=tables("sliding_attention") if main != "sliding_attention" and len(kinds) > 1 else None,
            router=router,
        )

    def router_stats(self, group: int, tokens: int) -> RouterStats | None:
        """What a row group keeps of its routing, when the config asks for the load-balancing loss."""
        return RouterStats(group, tokens) if self.cfg.moe and self.cfg.router_aux_coef else None

    def router_loss(self, mbs: list[MicroBatch], micro_batches: int) -> torch.Tensor:
        """The step's load-balancing loss, once the forward has routed every row group of these micro-batches
        (of ``micro_batches`` in the step, those of other ranks included), and the gradient each layer's backward
        adds through its router.

        HF's loss of one forward call (a micro-batch of N tokens through L MoE layers, R = L N rows): with
        f_e the share of the R x k top-k assignments that went to expert e and P_e the mean routing probability
        of e over the R rows, aux = E sum_e f_e P_e, weighted by router_aux_loss_coef. The step's loss adds the
        mean of its micro-batches' terms (one micro-batch: exactly HF's loss), so that the term's weight does
        not grow with gradient accumulation. d aux / d p = E f_e / R at every row (f_e does not depend on p)."""
        cfg = self.cfg
        stats: list[RouterStats] = []
        for mb in mbs:
            assert mb.router is not None, "the forward of a MoE model with the load-balancing loss routed it"
            stats.append(mb.router)
        E, L, coef = cfg.num_experts, len(cfg.moe_layers), cfg.router_aux_coef / micro_batches
        groups: dict[int, list] = {}
        for st in stats:
            c = torch.stack(list(st.counts.values())).sum(0)
            p = torch.stack(list(st.probs.values())).sum(0)
            g = groups.setdefault(st.group, [0, 0, 0])
            g[0], g[1], g[2] = g[0] + c, g[1] + p, g[2] + st.tokens
        total: torch.Tensor | None = None
        grads = {}
        for group, (c, p, tokens) in groups.items():
            rows = L * tokens
            f, P = c / rows, p / rows
            term = E * (f * P).sum()
            total = term if total is None else total + term
            grads[group] = coef * E * f / rows
        for st in stats:
            st.grad_E = grads[st.group]
        assert total is not None, "a step routes at least one row group"
        return total * coef

    # ---- the decoder layer -------------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.cfg.norm_offset:
            return self.ops.rms_norm(x, weight, self.cfg.rms_norm_eps, self.cfg.norm_offset)
        return self.ops.rms_norm(x, weight, self.cfg.rms_norm_eps)

    @staticmethod
    def _adapted(w, key, sinks) -> bool:
        """Whether projection ``key`` has an adapter (its weight then frozen: no gradient sink on it)."""
        if key + ".lora_A" not in w:
            return False
        assert key not in (sinks or {}), f"{key} has an adapter and a weight gradient: an adapted weight is frozen"
        return True

    def _proj(self, x, w, key, lora, sinks):
        if self._adapted(w, key, sinks):
            return _lora_linear(x, w, key, lora)
        sink = sinks or {}
        return linear(x, w[key], w.get(key + "_b"), sink.get(key), sink.get(key + "_b"))

    def _projs(self, x, w, keys: tuple[str, ...], lora, sinks) -> tuple[torch.Tensor, ...]:
        """Projections ``keys`` of the same x; the adapted ones together (``_LoraLinears``) where there are two
        or more and no dropout (each adapter draws its own mask, so their inputs differ)."""
        grouped = [key for key in keys if self._adapted(w, key, sinks)]
        if len(grouped) < 2 or lora is None or lora.dropout > 0:
            return tuple(self._proj(x, w, key, lora, sinks) for key in keys)
        weights = [t for key in grouped for t in (w[key], w.get(key + "_b"), w[key + ".lora_A"], w[key + ".lora_B"])]
        out = dict(zip(grouped, _LoraLinears.apply(x, lora.scaling, *weights)))
        return tuple(out[key] if key in out else self._proj(x, w, key, lora, sinks) for key in keys)

    def _layer(self, j: int | None) -> Layer:
        if j is None:
            if not self._uniform:
                raise ValueError(f"the layers of this {self.cfg.arch} model differ: pass the layer's index j")
            return self.cfg.layers[0]
        return self.cfg.layers[j]

    def layer(self, x_BTD: torch.Tensor, w: dict, mb: MicroBatch, lora: LoraCall | None = None,
              sinks: dict | None = None, j: int | None = None) -> torch.Tensor:
        """Decoder layer j, as its blocks describe it (the index matters where layers differ: Gemma's sliding
        and global layers, dense and MoE layers, the embedding's scale at the bottom, a MoE layer's routing
        statistics)."""
        y = self._forward(x_BTD, w, mb, lora, sinks, j, defer=False)
        assert isinstance(y, torch.Tensor)
        return y

    def layer_for_backward(self, x_BTD: torch.Tensor, w: dict, mb: MicroBatch, lora: LoraCall | None = None,
                           sinks: dict | None = None, j: int | None = None) -> torch.Tensor | Deferred:
        """``layer`` recomputed for its backward: where the layer ends in a plain projection added to the
        residual (a dense MLP's down projection, without a norm after it or an adapter on it), that projection
        is left to the backward (``Deferred``)."""
        return self._forward(x_BTD, w, mb, lora, sinks, j, defer=True)

    def _forward(self, x_BTD, w, mb: MicroBatch, lora: LoraCall | None, sinks: dict | None, j: int | None,
                 defer: bool) -> torch.Tensor | Deferred:
        cfg, ops, spec = self.cfg, self.ops, self._layer(j)
        a = spec.attn
        cos, sin, mask = mb.attention_inputs(a.kind)
        if cfg.embed_scale and j == 0:
            # Gemma scales the embeddings by sqrt(hidden) in their dtype, here at the bottom layer's input so
            # that its backward carries the factor into the embedding's gradient
            x_BTD = x_BTD * torch.tensor(cfg.hidden_size**0.5).to(x_BTD.dtype)
        B, T, D = x_BTD.shape
        hd = a.head_dim
        h = self._norm(x_BTD, w["ln1"])
        if "qkv" in w:
            q, k, v = self._proj(h, w, "qkv", lora, sinks).split([a.q_dim, a.kv_dim, a.kv_dim], dim=-1)
        else:
            q, k, v = self._projs(h, w, FUSED["qkv"], lora, sinks)
        if a.qk_norm == "proj":  # OLMoE: over the whole projection
            q, k = self._norm(q, w["q_norm"]), self._norm(k, w["k_norm"])
        q = q.view(B, T, a.num_heads, hd)
        k = k.view(B, T, a.num_kv_heads, hd)
        if a.qk_norm == "head":  # Qwen3, Gemma 3: each head
            q, k = self._norm(q, w["q_norm"]), self._norm(k, w["k_norm"])
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, a.num_kv_heads, hd).transpose(1, 2)
        q, k = ops.rope(q, k, cos, sin)
        if mb.cache is not None:  # generation: the queries of this call see the cached positions too
            assert j is not None, "a KV cache is kept per layer: pass the layer's index j"
            k, v = mb.cache.extend(j, k, v)
        # grouped-query attention without materialising repeated k/v heads
        if a.softcap:
            attn = softcap_attention(q, k, v, mask, cfg.attn_scale, a.softcap)
        else:
            attn = ops.attention(q, k, v, mask, cfg.attn_scale)
        attn = attn.transpose(1, 2).reshape(B, T, a.q_dim)
        if spec.sandwich_norms:
            x_BTD = x_BTD + self._norm(self._proj(attn, w, "o", lora, sinks), w["ln1_post"])
        else:
            x_BTD = x_BTD + self._proj(attn, w, "o", lora, sinks)
        h = self._norm(x_BTD, w["ln2"])
        if isinstance(spec.mlp, MoE):
            return x_BTD + self._experts(h, w, mb, lora, sinks, j, spec.mlp)
        mlp = self._mlp(h, w, spec.mlp, lora, sinks)
        down = spec.mlp.key + "down"
        if spec.sandwich_norms:
            return x_BTD + self._norm(self._proj(mlp, w, down, lora, sinks), w["ln2_post"])
        if defer and down + ".lora_A" not in w:
            return Deferred(x_BTD, mlp, down)
        return x_BTD + self._proj(mlp, w, down, lora, sinks)

    def _mlp(self, h, w, mlp: DenseMLP, lora: LoraCall | None, sinks: dict | None):
        """act(gate(h)) * up(h) of a gated MLP (down is the caller's)."""
        ops, key = self.ops, mlp.key
        if key + "gate_up" in w:
            gate_up = self._proj(h, w, key + "gate_up", lora, sinks)
            return ops.swiglu(gate_up) if mlp.act == "silu" else ops.geglu(gate_up)
        gate, up = self._projs(h, w, tuple(key + member for member in FUSED["gate_up"]), lora, sinks)
        if mlp.act == "silu":
            return ops.silu_mul(gate, up)
        return F.gelu(gate, approximate="tanh") * up

    def _experts(self, h_BTD, w, mb: MicroBatch, lora: LoraCall | None, sinks: dict | None, j: int | None,
                 moe: MoE):
        """The mixture of experts of a MoE layer: route, sort the token copies by expert, run each expert once
        over its tokens, sum each token's k outputs weighted by the router; plus the shared expert where the
        layer has one, scaled by the sigmoid of its gate."""
        ops = self.ops
        B, T, D = h_BTD.shape
        E, k = moe.num_experts, moe.top_k
        x_ND = h_BTD.reshape(-1, D)
        logits_NE = self._proj(x_ND, w, "router", lora, sinks)
        stats = mb.router
        if stats is not None and stats.grad_E is not None and torch.is_grad_enabled():
            logits_NE = _RouterAuxGrad.apply(logits_NE, stats.grad_E)
        probs_NE = torch.softmax(logits_NE.float(), dim=-1)
        top_w, top_e = torch.topk(probs_NE, k, dim=-1) if self.routing is None else self.routing.top_k(probs_NE, k)
        if moe.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        flat_e = top_e.reshape(-1)
        counts_E = expert_counts(flat_e, E)
        if stats is not None:  # idempotent: the recompute of the backward writes the same numbers again
            stats.counts[j] = counts_E.float()
            stats.probs[j] = probs_NE.detach().sum(0)
        routes = ops.moe_routes(flat_e, k)  # token copies grouped by expert, in token order within
        x_MD = ops.moe_dispatch(x_ND, routes)
        gate_up = self._expert_proj(x_MD, w, "experts.gate_up", counts_E, lora, sinks)
        out_MD = self._expert_proj(ops.swiglu(gate_up), w, "experts.down", counts_E, lora, sinks)
        # HF keeps Mixtral's routing weights in fp32 for the product
        y = ops.moe_combine(out_MD, top_w, routes, moe.fp32_combine).view(B, T, D)
        if moe.shared is None:
            return y
        shared = self._proj(self._mlp(x_ND, w, moe.shared, lora, sinks), w, moe.shared.key + "down", lora, sinks)
        gate_N1 = torch.sigmoid(self._proj(x_ND, w, "shared_gate", lora, sinks))
        return y + (gate_N1 * shared).view(B, T, D)

    def _expert_proj(self, x_MI, w, key: str, counts_E, lora: LoraCall | None, sinks: dict | None):
        """One stacked projection of the experts, with its LoRA adapter when the layer has one: PEFT's adapter of
        a stacked parameter, A [r x E, in] (expert e's rows e r .. e r + r - 1) and B [out, r x E] (expert e's
        columns e, E + e, ..., every E-th), scaling x B_e A_e added to each expert's weight."""
        y = expert_linear(x_MI, w[key], counts_E, (sinks or {}).get(key), fused=self.ops.fused)
        a = w.get(key + ".lora_A")
        if a is None:
            return y
        assert lora is not None, "weights with adapters come with their LoraCall"
        E = w[key].shape[0]
        r = a.shape[0] // E
        b = w[key + ".lora_B"]
        a3, b3 = a.view(E, r, a.shape[1]), b.view(b.shape[0], r, E).permute(2, 0, 1)
        # in the compute dtype, the fp32 factors cast to it (as _LoraLinear and PEFT under autocast do)
        u = expert_linear(x_MI, a3.to(y.dtype), counts_E)
        return torch.add(y, expert_linear(u, b3.to(y.dtype), counts_E), alpha=lora.scaling)

    # ---- the head ------------------------------------------------------------------------------------------

    def final_norm(self, h: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
        return self._norm(h, norm_w)

    def logits(self, h: torch.Tensor, w: dict) -> torch.Tensor:
        """The LM head's logits in float32 (soft-capped where the config caps them)."""
        return cap_logits(F.linear(self.final_norm(h, w["norm"]), w["lm_head"]).float(), self.cfg.final_softcap)

    def row_logps(self, h_BTD: torch.Tensor, w: dict, targets_BT: torch.Tensor, chunk: int) -> torch.Tensor:
        """Each row's log-probability of its targets summed over the non-ignored ones ([B] float32), through the
        final norm and the LM head in chunks of tokens (no full logits)."""
        B, T, D = h_BTD.shape
        hn = self.final_norm(h_BTD.reshape(-1, D), w["norm"])
        targets_N = targets_BT.reshape(-1)
        logp_N = torch.empty(B * T, dtype=torch.float32, device=h_BTD.device)
        for lo in range(0, hn.shape[0], chunk):
            logp_N[lo:lo + chunk] = self.ops.token_logps(F.linear(hn[lo:lo + chunk], w["lm_head"]),
                                                         targets_N[lo:lo + chunk], self.cfg.final_softcap)
        return logp_N.view(B, T).sum(1)

    def head_loss(self, h_ND: torch.Tensor, w: dict, targets_N: torch.Tensor, scale: float | torch.Tensor, chunk: int,
                  sinks: dict | None = None, need_dh: bool = False):
        """scale x the summed cross-entropy of these tokens (float32 scalar) through the final norm and the LM
        head, in chunks of tokens so that full logits never exist. Training (``need_dh`` or ``sinks``): also
        dL/dh (or None), with the LM head's gradient added into ``sinks["lm_head"]`` and the final norm's into
        ``sinks["norm"]``, for whichever of the two the sinks hold. ``scale``: one factor, or one per token ([N]
        float32)."""
        sinks = sinks or {}
        train = need_dh or bool(sinks)
        norm_w, lm_w = w["norm"], w["lm_head"]
        cap = self.cfg.final_softcap
        if not train:
            hn = self.final_norm(h_ND, norm_w)
            total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
            for lo in range(0, hn.shape[0], chunk):
                total += self.ops.cross_entropy_(F.linear(hn[lo:lo + chunk], lm_w), targets_N[lo:lo + chunk],
                                                 _chunk_of(scale, lo, lo + chunk), grad=False, softcap=cap)
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
            total += self.ops.cross_entropy_(logits, targets_N[lo:hi], _chunk_of(scale, lo, hi), grad=True, softcap=cap)
            # the logits now hold dL/dlogits: back through the LM head's matmul
            torch.mm(logits, lm_w, out=d_hn[lo:hi])
            if "lm_head" in sinks:
                accumulate_mm(sinks["lm_head"], logits.t(), hn_d[lo:hi])
            del logits  # else a chunk's logits live on while the next chunk's are made: two chunks at the peak
        wanted = [t for t in (h_leaf, norm_leaf) if t.requires_grad]
        grads = dict(zip([id(t) for t in wanted], torch.autograd.grad(hn, wanted, d_hn)))
        if norm_leaf.requires_grad:
            sinks["norm"].add_(grads[id(norm_leaf)])
        return total, grads.get(id(h_leaf))


def _chunk_of(scale: float | torch.Tensor, lo: int, hi: int) -> float | torch.Tensor:
    """The scale of tokens lo..hi: a per-token scale's slice, or the one factor."""
    return scale[lo:hi] if isinstance(scale, torch.Tensor) else scale
