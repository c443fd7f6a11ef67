"""The layer template's elementwise work and its weight gradients, fused where the device allows.

Two sets of kernels compute the same functions:
- ``torch``: plain torch ops with HF transformers' arithmetic (RMSNorm in float32, RoPE and SwiGLU in the
  compute dtype, cross-entropy on float32 logits). Always used on the CPU, so the numerics tests pin the
  math against HF.
- ``liger``: Liger-Kernel's Triton kernels (RMSNorm with HF's Llama casting, RoPE, SwiGLU, the
  cross-entropy kernel that writes the logits' gradient in place). CUDA only, when ``liger_kernel`` is
  installed (``pip install horizon-ray[gpu]``). Each kernel rounds once where the torch ops round after
  every op, so bf16 results differ from HF's in the last bits; in float32 they agree to roundoff.

The families beyond Llama add: RMSNorm scaling by (1 + w) in fp32 (Gemma; Liger's "gemma" casting with offset
1), the GELU-tanh gated MLP (torch's gelu), soft-capped logits in the loss (Liger's kernel caps in place),
attention with soft-capped scores (``softcap_attention``: SDPA cannot cap, so an exact attention over blocks
of queries that recomputes its probabilities in the backward, memory O(block x keys)), and the experts of a
mixture-of-experts layer (``expert_linear``: tokens sorted by expert, one GEMM per expert, or on CUDA in bfloat16
torch's grouped GEMM for all of them, forward, dL/dx and the experts' weight gradients alike; with the fused set
on CUDA, the tokens' dispatch and combine and the weight gradients' accumulation in Triton: ``moe_kernels``).

Weight gradients never exist as tensors of their own: ``linear`` takes the fp32 accumulator of its weight
(a view of the unit's gradient buffer on the device) and its backward adds ``dy^T x`` into it, on CUDA
inside the GEMM (``addmm`` with an fp32 output from bf16 operands), so a layer's backward writes each
weight gradient once instead of materialising it in bf16 and adding it in a second pass.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from horizon_ray.engine.model import KERNELS, torch_ce_rows
from horizon_ray.errors import BadInput

log = logging.getLogger(__name__)

_CUDA_ATTENTION = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]


def liger_available() -> bool:
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
    except Exception:  # not installed, or no triton / GPU backend for it
        return False
    return True


def resolve_kernels(name: str, device: torch.device) -> str:
    """'auto' -> 'liger' on CUDA when Liger-Kernel imports, else 'torch'; 'liger' off CUDA is refused."""
    if name not in KERNELS:
        raise BadInput(f"kernels must be one of {KERNELS}, got {name!r}")
    if name == "torch":
        return "torch"
    if device.type != "cuda":
        if name == "liger":
            raise BadInput("kernels='liger' runs Triton kernels on a CUDA device; this engine runs on "
                             f"{device.type}: use kernels='auto' or 'torch'")
        return "torch"
    if liger_available():
        return "liger"
    if name == "liger":
        raise BadInput("kernels='liger' needs the liger-kernel package (pip install 'horizon-ray[gpu]'); "
                         "or use kernels='auto', which falls back to torch ops")
    log.warning("liger-kernel is not installed: the layer template runs unfused torch ops on CUDA "
                "(pip install 'horizon-ray[gpu]' for the fused kernels)")
    return "torch"


# ---- bfloat16 GEMMs on a CPU without native ones ------------------------------------------------------------

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.addmm_.default,
            _aten.mm.out, _aten.bmm.out, _aten.addmm.out}


class _Fp32Matmuls(TorchDispatchMode):
    """Every bfloat16 GEMM on the CPU (forward and backward: autograd runs a CPU backward on the calling thread)
    as a float32 GEMM of the same operands, rounded to bfloat16 once: what a bfloat16 GEMM that accumulates in
    float32 computes, up to the order of its sums. On a CPU without native bfloat16 GEMMs (oneDNN's need AVX-512
    or AMX) torch's fallback ran a 256 x 256 x 704 product in 33 ms against 0.9 ms this way (an AVX2 EPYC), and
    the engine's bf16 steps 12x slower than these."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _MATMULS or not _bf16_cpu(args):
            return func(*args, **kwargs)
        wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        if func is _aten.addmm_.default:
            return args[0].copy_(_aten.addmm.default(*wide, **kwargs))
        if "out" in kwargs:  # the out= forms: the product in float32, then into the caller's tensor
            out = kwargs.pop("out")
            return out.copy_(func.overloadpacket.default(*wide, **kwargs))
        return func(*wide, **kwargs).to(torch.bfloat16)


def _bf16_cpu(args) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


@functools.cache
def native_bf16_gemms() -> bool:
    """Whether this CPU runs bfloat16 GEMMs natively (oneDNN's check: AVX-512 BW/VL/DQ or AMX); asked once."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def matmul_mode(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Where the engine's GEMMs run in float32 (``_Fp32Matmuls``): bfloat16 on a CPU without native bfloat16
    GEMMs; elsewhere nothing changes. Deterministic for a machine: the choice is the CPU's, not a timing."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16_gemms():
        return _Fp32Matmuls()
    return contextlib.nullcontext()


def gemms_in_mode(fn):
    """A method of an object with ``device`` and ``dtype`` (the engine, the generator) that runs its compute with
    its GEMMs in their ``matmul_mode``."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        with matmul_mode(self.device, self.dtype):
            return fn(self, *args, **kwargs)
    return run


# ---- linear layers with gradient sinks ---------------------------------------------------------------------


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc in fp32: inside the GEMM on CUDA, through a product tensor on the CPU."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif acc.is_cuda:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


class _SinkLinear(torch.autograd.Function):
    """y = x W^T (+ b); the backward returns dL/dx and adds dL/dW (and dL/db) into fp32 accumulators."""

    @staticmethod
    def forward(ctx, x, w, b, gw, gb):
        ctx.save_for_backward(x, w)
        ctx.sinks = (gw, gb)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gw, gb = ctx.sinks
        return linear_backward(gy, x, w, gw, gb, ctx.needs_input_grad[0]), None, None, None, None


def linear_backward(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gw: torch.Tensor | None,
                    gb: torch.Tensor | None, need_gx: bool = True) -> torch.Tensor | None:
    """The backward of y = x W^T (+ b): dL/dW (and dL/db) added into their fp32 sinks, where given (a frozen
    weight has none); returns dL/dx."""
    gy_N = gy.reshape(-1, gy.shape[-1])
    if gw is not None:
        accumulate_mm(gw, gy_N.t(), x.reshape(-1, x.shape[-1]))
    if gb is not None:
        gb.add_(gy_N.sum(0, dtype=gb.dtype))
    return gy @ w if need_gx else None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, gw: torch.Tensor | None = None,
           gb: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; with gw (and gb for a bias), the backward accumulates the weight's gradient there."""
    if gw is None or not torch.is_grad_enabled():
        return F.linear(x, w, b)
    return _SinkLinear.apply(x, w, b, gw, gb)


# ---- mixture-of-experts: one grouped GEMM over every expert's tokens ---------------------------------------

# Devices whose experts run through torch's grouped GEMM. The CPU runs one GEMM per expert, so that the numerics
# tests pin the plain path against HF; tests add "cpu" to run the grouped path on torch's CPU implementation.
GROUPED_MM_DEVICES = ("cuda",)


def _grouped(x: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    """torch's grouped GEMM serves: bfloat16 on a device of GROUPED_MM_DEVICES, every width a multiple of
    8 elements (its kernels' rule: each row of an operand starts on a 16-byte boundary)."""
    return (x.device.type in GROUPED_MM_DEVICES and x.dtype == torch.bfloat16 and w_EOI.dtype == x.dtype
            and hasattr(F, "grouped_mm") and x.shape[-1] % 8 == 0 and w_EOI.shape[-2] % 8 == 0
            and w_EOI.shape[-1] % 8 == 0)


def _gmm_layout(t: torch.Tensor) -> torch.Tensor:
    """t itself where the grouped GEMM takes its layout, else a contiguous copy. Its rule, by strides and not by
    shape: one of the last two dims has stride 1, the other a stride of at least that dim's size and a multiple of
    16 bytes, and the data starts on 16 bytes. A view can hold a valid shape in a layout the kernel refuses:
    LoRA's stacked B of the experts, [out, r x E] viewed as [E, out, r], has strides (1, r E, E)."""
    st, sz = t.stride(), t.shape
    align = 16 // t.element_size()
    row_major = st[-1] == 1 and st[-2] >= max(1, sz[-1]) and st[-2] % align == 0
    col_major = st[-2] == 1 and st[-1] >= max(1, sz[-2]) and st[-1] % align == 0
    if (row_major or col_major) and t.data_ptr() % 16 == 0:
        return t
    c = t.contiguous()
    return c if c.data_ptr() % 16 == 0 else c.clone()


def _offsets(counts_E: torch.Tensor) -> torch.Tensor:
    """Each expert's end row, int32 on the device: the grouped GEMM reads them there (no host sync)."""
    return torch.cumsum(counts_E, 0, dtype=torch.int32)


def _expert_mm(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert, counts_E[e] of them for expert e: each block times its expert's W^T."""
    if _grouped(x_MI, w_EOI):
        return F.grouped_mm(_gmm_layout(x_MI), _gmm_layout(w_EOI.transpose(-2, -1)), offs=_offsets(counts_E))
    out = x_MI.new_empty(x_MI.shape[0], w_EOI.shape[1])
    lo = 0
    for e, n in enumerate(counts_E.tolist()):  # one GEMM per expert that has tokens
        if n:
            torch.mm(x_MI[lo:lo + n], w_EOI[e].t(), out=out[lo:lo + n])
            lo += n
    return out


def _expert_wgrad(gy_MO: torch.Tensor, x_MI: torch.Tensor, counts_E: torch.Tensor,
                  w_EOI: torch.Tensor) -> torch.Tensor | None:
    """Every expert's dL/dW_e = gy_e^T x_e in one grouped GEMM ([E, out, in] in the compute dtype), where it
    serves; None where it does not (the caller then runs one GEMM per expert). The block of an expert without
    rows sums over none of them and is not promised to be written: ``_zero_empty`` zeroes it."""
    if not _grouped(x_MI, w_EOI):
        return None
    return F.grouped_mm(_gmm_layout(gy_MO.t()), _gmm_layout(x_MI), offs=_offsets(counts_E))


def _zero_empty(g_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return g_EOI.masked_fill_((counts_E == 0)[:, None, None], 0)


class _ExpertLinear(torch.autograd.Function):
    """y = x W_e^T for each expert's block of rows; the backward returns dL/dx, dL/dW when W needs it (LoRA's
    stacked adapters), and adds each expert's dL/dW into the fp32 accumulator ``gw`` when one is given. On the
    grouped path the backward is two grouped GEMMs and reads no count on the host; with ``fused`` on CUDA the
    accumulation is one Triton pass that skips the experts without rows (moe_kernels)."""

    @staticmethod
    def forward(ctx, x, w, counts, gw, fused: bool):
        ctx.save_for_backward(x, w, counts)
        ctx.gw, ctx.fused = gw, fused
        return _expert_mm(x, w, counts)

    @staticmethod
    def backward(ctx, gy):
        x, w, counts = ctx.saved_tensors
        gw = ctx.gw
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = None
        if need_x:
            if _grouped(gy, w):
                gx = F.grouped_mm(_gmm_layout(gy), _gmm_layout(w), offs=_offsets(counts))
            else:
                gx = _expert_mm(gy, w.transpose(-2, -1), counts)
        if gw is None and not need_w:
            return gx, None, None, None, None
        g_EOI = _expert_wgrad(gy, x, counts, w)
        if g_EOI is not None:
            if gw is not None and not need_w and ctx.fused and gw.is_cuda:
                from horizon_ray.engine import moe_kernels

                if moe_kernels.accumulates(gw, g_EOI):
                    moe_kernels.accumulate_expert_grads(gw, g_EOI, counts)
                    return gx, None, None, None, None
            g_EOI = _zero_empty(g_EOI, counts)
            if gw is not None:
                gw.add_(g_EOI)
            return gx, g_EOI if need_w else None, None, None, None
        gw_out = torch.zeros_like(w) if need_w else None
        lo = 0
        for e, n in enumerate(counts.tolist()):  # an expert without tokens adds nothing
            if n:
                gy_e, x_e = gy[lo:lo + n], x[lo:lo + n]
                if gw is not None:
                    accumulate_mm(gw[e], gy_e.t(), x_e)
                if gw_out is not None:
                    gw_out[e] = gy_e.t() @ x_e
                lo += n
        return gx, gw_out, None, None, None


def expert_linear(x_MI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor,
                  gw_EOI: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """The experts' projection of rows sorted by expert (``counts_E[e]`` rows for expert e, in expert order):
    [M, in] -> [M, out] with w [E, out, in]. With gw (fp32, w's shape) the backward adds each expert's weight
    gradient there; an expert without rows gets none (its AdamW step then sees a zero gradient). ``fused``: the
    kernel set's Triton kernels may serve (Kernels.fused)."""
    if not torch.is_grad_enabled() or not (x_MI.requires_grad or w_EOI.requires_grad):
        return _expert_mm(x_MI, w_EOI, counts_E)
    return _ExpertLinear.apply(x_MI, w_EOI, counts_E, gw_EOI, fused)


# ---- attention with soft-capped scores -----------------------------------------------------------------------

# Elements of one block's scores [B, heads, queries, keys] in fp32: 64 Mi (256 MiB).
_SOFTCAP_BLOCK_ELEMENTS = 1 << 26


def _query_blocks(q_BHTd: torch.Tensor, T: int):
    rows = max(1, min(T, _SOFTCAP_BLOCK_ELEMENTS // max(1, q_BHTd.shape[0] * q_BHTd.shape[1] * T)))
    return [(lo, min(lo + rows, T)) for lo in range(0, T, rows)]


def _wide(t: torch.Tensor) -> torch.dtype:
    """The dtype scores and their gradients are kept in: fp32, or the inputs' if wider."""
    return torch.promote_types(t.dtype, torch.float32)


def _capped_scores(q_blk, k, scale: float, cap: float, mask_blk, lo: int, hi: int):
    """(scores after the cap, with -inf where masked; tanh(s / cap)) of queries lo..hi against every key, in fp32
    or wider:
    q [B, kvH, G, n, d], k [B, kvH, 1, T, d], mask [B | 1, 1, n, T] bool or None (causal)."""
    s = torch.matmul(q_blk, k.transpose(-2, -1)).to(_wide(q_blk)) * scale
    t = torch.tanh(s / cap)
    s = t * cap
    if mask_blk is None:
        qi = torch.arange(lo, hi, device=s.device)[:, None]
        allowed = torch.arange(k.shape[-2], device=s.device)[None, :] <= qi
    else:
        allowed = mask_blk[:, :, None]  # [B, 1, 1, n, T] against [B, kvH, G, n, T]
    return s.masked_fill(~allowed, float("-inf")), t


def _softcap_forward(q, k, v, mask, scale: float, cap: float):
    """(output [B, kvH, G, T, d], log-sum-exp of each row's capped scores [B, kvH, G, T] in fp32 or wider)."""
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    q5, k5, v5 = q.view(B, Hkv, Hq // Hkv, T, d), k[:, :, None], v[:, :, None]
    out = torch.empty_like(q5)
    lse = torch.empty(q5.shape[:-1], dtype=_wide(q), device=q.device)
    for lo, hi in _query_blocks(q, T):
        s, _ = _capped_scores(q5[:, :, :, lo:hi], k5, scale, cap, None if mask is None else mask[:, :, lo:hi], lo, hi)
        m = torch.logsumexp(s, dim=-1)
        lse[..., lo:hi] = m
        out[:, :, :, lo:hi] = torch.matmul(torch.exp(s - m[..., None]).to(v.dtype), v5)
    return out, lse


class _SoftcapAttention(torch.autograd.Function):
    """softmax(cap tanh(q k^T scale / cap) + mask) v, exact, over blocks of queries: the forward keeps the
    output and each row's log-sum-exp, the backward recomputes each block's probabilities from them, so no
    [T, T] score matrix outlives its block. Grouped-query heads: query head h reads key/value head h // G."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, cap: float):
        out, lse = _softcap_forward(q, k, v, mask, scale, cap)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.args = (scale, cap)
        return out.view(q.shape)

    @staticmethod
    def backward(ctx, g_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        scale, cap = ctx.args
        B, Hq, T, d = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        q5, k5, v5 = q.view(B, Hkv, G, T, d), k[:, :, None], v[:, :, None]
        go = g_out.reshape(B, Hkv, G, T, d)
        gq = torch.empty_like(q5)
        wide = _wide(q)
        gk = torch.zeros(B, Hkv, T, d, dtype=wide, device=q.device)
        gv = torch.zeros_like(gk)
        # D_i = sum_j P_ij dP_ij = dO_i . O_i (the softmax's backward, row by row)
        D = (go.to(wide) * out.to(wide)).sum(-1)
        for lo, hi in _query_blocks(q, T):
            qb = q5[:, :, :, lo:hi]
            s, t = _capped_scores(qb, k5, scale, cap, None if mask is None else mask[:, :, lo:hi], lo, hi)
            p = torch.exp(s - lse[..., lo:hi, None])  # [B, kvH, G, n, T]
            gob = go[:, :, :, lo:hi]
            gv += torch.matmul(p.transpose(-2, -1), gob.to(wide)).sum(2)
            dp = torch.matmul(gob, v5.transpose(-2, -1)).to(wide)
            ds = p * (dp - D[..., lo:hi, None])
            ds = ds * (1.0 - t * t) * scale  # through the cap and the scale
            gq[:, :, :, lo:hi] = torch.matmul(ds.to(q.dtype), k5)
            gk += torch.matmul(ds.transpose(-2, -1), qb.to(wide)).sum(2)
        return gq.view(B, Hq, T, d), gk.to(k.dtype), gv.to(v.dtype), None, None, None


def softcap_attention(q_BHTd, k_BHTd, v_BHTd, mask_B1TT, scale: float, cap: float) -> torch.Tensor:
    """Causal (or masked) attention whose scores are soft-capped, c tanh(s / c), before the mask and softmax
    (Gemma 2), with grouped-query heads; [B, heads, T, head_dim]."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHTd, k_BHTd, v_BHTd)):
        return _SoftcapAttention.apply(q_BHTd, k_BHTd, v_BHTd, mask_B1TT, scale, cap)
    with torch.no_grad():
        return _softcap_forward(q_BHTd, k_BHTd, v_BHTd, mask_B1TT, scale, cap)[0].view(q_BHTd.shape)


# ---- the elementwise kernels ------------------------------------------------------------------------------


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class Routes:
    """A MoE layer's token copies sorted by expert (Kernels.moe_routes)."""

    order_M: torch.Tensor  # sorted row m holds token copy order[m] (token order[m] // k, its (order[m] % k)-th expert)
    inv_M: torch.Tensor | None  # its inverse, inv[order[m]] = m: the fused kernels' gathers read it; None elsewhere
    k: int  # experts a token


@dataclass(frozen=True)
class Kernels:
    """One set of kernels for the layer template; ``name`` is 'torch' or 'liger' (see the module)."""

    name: str = "torch"

    @property
    def fused(self) -> bool:
        return self.name == "liger"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
        if offset:
            return self._rms_norm_offset(x, weight, eps, offset)
        if self.fused and weight.dtype == x.dtype:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # in_place=False: the incoming gradient may be read again by the residual branch's add
            return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if weight.dtype == x.dtype:
            return weight * x32.to(x.dtype)  # HF's arithmetic
        # a trained fp32 norm (LoRA's modules_to_save) on narrower activations: the product in fp32, so that
        # the weight is used, and its gradient accumulated, at full precision; HF's bits for a bf16 weight
        return (weight * x32.to(x.dtype).float()).to(x.dtype)

    def _rms_norm_offset(self, x, weight, eps: float, offset: float) -> torch.Tensor:
        """Gemma's RMSNorm: x / rms(x) x (offset + w), all in fp32, cast back once."""
        if self.fused and weight.dtype == x.dtype:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return LigerRMSNormFunction.apply(x, weight, eps, offset, "gemma", False)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * (offset + weight.float())).to(x.dtype)

    def rope(self, q_BHTd: torch.Tensor, k_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor):
        """HF's rotate-half RoPE of q and k ([B, heads, T, head_dim]); cos/sin [B, T, head_dim]."""
        if self.fused:
            from liger_kernel.ops.rope import LigerRopeFunction

            return LigerRopeFunction.apply(q_BHTd, k_BHTd, cos_BTd, sin_BTd)
        cos, sin = cos_BTd[:, None], sin_BTd[:, None]
        return q_BHTd * cos + _rotate_half(q_BHTd) * sin, k_BHTd * cos + _rotate_half(k_BHTd) * sin

    def attention(self, q_BHTd, k_BHTd, v_BHTd, mask_B1TT, scale: float) -> torch.Tensor:
        """Causal (or masked) scaled dot-product attention with grouped-query heads, [B, heads, T, head_dim].
        On CUDA with the fused set, cuDNN's attention comes first (0.90 ms against flash's 1.43 ms for the
        forward and backward of a 7B layer's 8 x 1024 tokens on the H200), flash where cuDNN refuses.

        One query a row with a mask (a decode step) and grouped heads: the query heads that share a key/value
        head become that head's queries ([B, kv heads, group, head_dim]; the mask broadcasts over them), so no
        kernel repeats the cached keys and values for every query head (SDPA's math path does, for GQA) and the
        kernels without grouped-query support (the memory-efficient one, which takes masks) apply."""
        B, H, T, d = q_BHTd.shape
        kvH = k_BHTd.shape[1]
        if H != kvH and T == 1 and mask_B1TT is not None:
            out = self._sdpa(q_BHTd.reshape(B, kvH, H // kvH, d), k_BHTd, v_BHTd, mask_B1TT, scale)
            return out.reshape(B, H, 1, d)
        return self._sdpa(q_BHTd, k_BHTd, v_BHTd, mask_B1TT, scale)

    def _sdpa(self, q, k, v, mask, scale: float) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        kw = {"is_causal": True} if mask is None else {"attn_mask": mask}
        if not (self.fused and q.is_cuda):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **kw)
        with sdpa_kernel(_CUDA_ATTENTION, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **kw)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [..., 2 x ffn] tensor holding gate then up (one GEMM made both)."""
        if self.fused:
            from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

            # on a 2-D view: the kernel's backward returns its gradient as [rows, 2 x ffn]
            rows = gate_up.view(-1, gate_up.shape[-1])
            return LigerFusedGateUpSiLUMulFunction.apply(rows).view(*gate_up.shape[:-1], -1)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of two GEMMs' outputs. Liger's kernel writes its gradients over the two saved inputs:
        both must be this op's alone (a projection's output is; an on-disk fused gate_up's halves are not: swiglu)."""
        if self.fused:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply(gate, up)
        return F.silu(gate) * up

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up of a [..., 2 x ffn] tensor holding gate then up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def moe_routes(self, flat_e: torch.Tensor, k: int) -> Routes:
        """The N x k token copies of a MoE layer (flat_e: each copy's expert, token-major) sorted by expert, in
        token order within an expert; with the fused set on CUDA also the inverse permutation its kernels read."""
        order_M = torch.argsort(flat_e, stable=True)
        inv_M = None
        if self.fused and flat_e.is_cuda:
            inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(order_M.numel(), device=flat_e.device))
        return Routes(order_M, inv_M, k)

    def moe_dispatch(self, x_ND: torch.Tensor, routes: Routes) -> torch.Tensor:
        """The expert-sorted copies of a MoE layer's tokens: row m is token order[m] // k. The fused backward sums
        each token's k gradients in one gather (moe_kernels); torch's indexing backward sorts and accumulates."""
        if routes.inv_M is not None:
            from horizon_ray.engine import moe_kernels

            return moe_kernels.dispatch(x_ND, routes.order_M, routes.inv_M, routes.k)
        return x_ND[routes.order_M // routes.k]

    def moe_combine(self, out_MD: torch.Tensor, w_Nk: torch.Tensor, routes: Routes,
                    fp32_product: bool) -> torch.Tensor:
        """[N, hidden]: each token's k expert outputs (sorted rows of out_MD) times its router weights (w_Nk,
        fp32), summed. The products are rounded to the outputs' dtype, with the weight rounded first, or in fp32
        with ``fp32_product`` (HF's Mixtral); the sum in fp32, rounded once."""
        order_M = routes.order_M
        if routes.inv_M is not None:
            from horizon_ray.engine import moe_kernels

            return moe_kernels.combine(out_MD, w_Nk.reshape(-1), order_M, routes.inv_M, routes.k,
                                       round_w=not fp32_product)
        weights_M = w_Nk.reshape(-1)[order_M]
        if fp32_product:
            out_MD = (out_MD * weights_M[:, None]).to(out_MD.dtype)
        else:
            out_MD = out_MD * weights_M.to(out_MD.dtype)[:, None]
        # back to token order, then each token's k outputs summed
        y = out_MD.new_empty(out_MD.shape).index_copy(0, order_M, out_MD)
        return y.view(-1, routes.k, y.shape[-1]).sum(1)

    def cross_entropy_(self, logits_NV: torch.Tensor, targets_N: torch.Tensor, scale: float | torch.Tensor,
                       grad: bool, softcap: float | None = None) -> torch.Tensor:
        """Sum over the chunk of scale x CE(logits, targets) (float32 scalar, -100 ignored), computed on
        float32 logits as HF does; with ``softcap`` on c tanh(logits / c). With grad, the logits are overwritten
        by the gradient of that sum (by the logits before the cap). ``scale``: one factor, or one per token
        ([N] float32, a preference step's weights)."""
        if isinstance(scale, torch.Tensor):
            # each row of the gradient is linear in its token's factor: the unscaled kernel, then the rows scaled
            nll_N = self.token_logps(logits_NV, targets_N, softcap).neg_()
            if grad:
                self.cross_entropy_(logits_NV, targets_N, 1.0, grad=True, softcap=softcap)
                logits_NV.mul_(scale[:, None].to(logits_NV.dtype))
            return (nll_N * scale).sum()
        if self.fused:
            return _liger_cross_entropy_(logits_NV, targets_N, scale, grad, softcap)
        # torch's: in slices of rows whose float32 temporaries fit within the logits' own bytes (torch_ce_rows)
        total = torch.zeros((), dtype=torch.float32, device=logits_NV.device)
        for lo, hi in _ce_slices(logits_NV):
            z, t = logits_NV[lo:hi], targets_N[lo:hi]
            if not grad:
                total += F.cross_entropy(cap_logits(z.float(), softcap), t, ignore_index=-100, reduction="sum")
                continue
            with torch.enable_grad():
                leaf = z.detach().requires_grad_()
                loss = F.cross_entropy(cap_logits(leaf.float(), softcap), t, ignore_index=-100,
                                       reduction="sum") * scale
                (g,) = torch.autograd.grad(loss, [leaf])
            z.copy_(g)
            total += loss.detach()
            del g, loss, leaf  # freed before the next slice's temporaries are made
        return total if grad else total * scale


    def token_logps(self, logits_NV: torch.Tensor, targets_N: torch.Tensor,
                    softcap: float | None = None) -> torch.Tensor:
        """log p(target) of each token ([N] float32; 0 where the target is -100), on float32 logits as HF does."""
        if self.fused:
            return _liger_cross_entropy_(logits_NV, targets_N, 1.0, False, softcap, per_token=True).neg_()
        return -torch.cat([F.cross_entropy(cap_logits(logits_NV[lo:hi].float(), softcap), targets_N[lo:hi],
                                           ignore_index=-100, reduction="none") for lo, hi in _ce_slices(logits_NV)])


def _ce_slices(logits_NV: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges of the logits that torch's cross-entropy takes at once (model.torch_ce_rows)."""
    n = logits_NV.shape[0]
    step = torch_ce_rows(n, logits_NV.element_size())
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, 0)]


def cap_logits(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """c tanh(z / c), HF's soft-capping; z itself without a cap."""
    if softcap is None:
        return z
    return torch.tanh(z / softcap) * softcap


def _liger_cross_entropy_(logits_NV, targets_N, scale: float, grad: bool, softcap: float | None,
                          per_token: bool = False) -> torch.Tensor:
    import triton
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel

    n, V = logits_NV.shape
    loss_N = torch.zeros(n, dtype=torch.float32, device=logits_NV.device)
    # reduction "mean" with n_non_ignore = 1/scale: each row's loss and gradient come out multiplied by
    # scale (the step's 1 / target count), written in fp32 (loss) and into the logits (gradient)
    liger_cross_entropy_kernel[(n,)](
        X_ptr=logits_NV, X_stride=logits_NV.stride(-2), Y_ptr=targets_N, Y_stride=targets_N.stride(-1),
        weight_ptr=None, loss_ptr=loss_N, z_loss_ptr=None, loss_stride=loss_N.stride(-1),
        token_accuracy_ptr=None, token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0,
        n_cols=V, n_non_ignore=1.0 / scale, sum_non_ignore_weight=1.0 / scale, weight_sum=0.0, ignore_index=-100,
        lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=softcap, RETURN_Z_LOSS=False,
        RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
        BLOCK_SIZE=min(32768, triton.next_power_of_2(V)), HAS_WEIGHT=False, HAS_SOFTCAPPING=softcap is not None,
        HAS_GRADIENTS=grad, num_warps=32,
    )
    return loss_N if per_token else loss_N.sum()
