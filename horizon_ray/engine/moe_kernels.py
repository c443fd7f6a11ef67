"""A mixture-of-experts layer's token traffic on CUDA, each move one Triton kernel.

The layer (``layers.Template._experts``) copies every token to its k experts, sorted by expert (dispatch), runs
the experts' grouped GEMMs, then sums each token's k outputs weighted by the router (combine). In torch ops each
of those moves is several passes over the [N x k, hidden] copies: the combine is a product, a scatter back to
token order and a sum over k, and its backward as many again; the dispatch's backward is an accumulating
index_put that sorts its indices. At 65,536 token copies of 2,048 wide that traffic was 0.4-0.5 s of an
olmoe-1b-7b step of 65,536 tokens on the H200 (the profile in benchmarks/README.md), and the experts' weight
gradients took two more passes a row group: a masked fill of the experts without tokens and an fp32 add.

Here each is one pass:
- ``combine``: y[n] = sum_j out[copy (n, j)] x w[n, j], each product rounded to the activations' dtype as
  the torch expression rounds it (with the weight rounded first, or in fp32 for Mixtral's fp32 product), the
  sum in fp32 rounded once as torch's sum rounds it. Its backward writes dL/dout and dL/dw in one pass over
  the copies (dL/dw in fp32 without rounding the products first: closer to exact than the torch expression).
- ``dispatch``'s backward: dL/dx[n] = the sum of its k copies' gradients in fp32, a gather, no sort.
- ``accumulate_expert_grads``: gw[e] += g[e] in fp32 for the experts with tokens, skipping the rest, whose
  block of the grouped GEMM's output is not promised to be written.

``inv`` is the inverse of ``order`` (order[m] is the token copy n x k + j at sorted row m; inv[n x k + j] = m).
CUDA only; the callers keep the torch expressions elsewhere (the CPU numerics tests pin those against HF, and
``tests/gpu/test_cuda_moe_kernels.py`` pins these against them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_D = 1024  # hidden elements a program of the gathers covers
_BLOCK_ACC = 4096  # elements of an expert's gradient a program of the accumulation covers


@triton.jit
def _gather_sum_kernel(src_ptr, w_ptr, inv_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr,
                       ROUND_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[n] = sum_j round(src[inv[n K + j]] x w[n K + j]) (or the rows alone), accumulated in fp32."""
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        m = tl.load(inv_ptr + n * K + j).to(tl.int64)
        row = tl.load(src_ptr + m * D + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + n * K + j)
            if ROUND_W:
                w = w.to(src_ptr.dtype.element_ty).to(tl.float32)
            row = (row * w).to(src_ptr.dtype.element_ty).to(tl.float32)
        acc += row
    tl.store(out_ptr + n * D + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_backward_kernel(gy_ptr, out_ptr, w_ptr, order_ptr, gout_ptr, gw_ptr, D, K: tl.constexpr,
                             ROUND_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sorted row m, token copy s = order[m] of token n = s // K: dL/dout[m] = round(dL/dy[n] x w[s]) and
    dL/dw[s] = dL/dy[n] . out[m] in fp32."""
    m = tl.program_id(0).to(tl.int64)
    s = tl.load(order_ptr + m).to(tl.int64)
    n = s // K
    w = tl.load(w_ptr + s)
    if ROUND_W:
        w = w.to(out_ptr.dtype.element_ty).to(tl.float32)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        mask = d < D
        g = tl.load(gy_ptr + n * D + d, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(out_ptr + m * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(gout_ptr + m * D + d, (g * w).to(gout_ptr.dtype.element_ty), mask=mask)
        dot += g * o
    tl.store(gw_ptr + s, tl.sum(dot, axis=0))


@triton.jit
def _accumulate_kernel(acc_ptr, g_ptr, counts_ptr, per_expert, BLOCK: tl.constexpr):
    """acc[e] += g[e] (fp32) for an expert with tokens; an expert without any reads and writes nothing."""
    e = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < per_expert) & (tl.load(counts_ptr + e) > 0)
    at = e * per_expert + offs
    a = tl.load(acc_ptr + at, mask=mask)
    g = tl.load(g_ptr + at, mask=mask).to(tl.float32)
    tl.store(acc_ptr + at, a + g, mask=mask)


def _gather_sum(src_MD: torch.Tensor, w_M: torch.Tensor | None, inv_M: torch.Tensor, k: int,
                round_w: bool) -> torch.Tensor:
    M, D = src_MD.shape
    src_MD = src_MD.contiguous()
    out_ND = src_MD.new_empty(M // k, D)
    _gather_sum_kernel[(M // k, triton.cdiv(D, _BLOCK_D))](
        src_MD, w_M if w_M is not None else src_MD, inv_M, out_ND, D, K=k, HAS_W=w_M is not None,
        ROUND_W=round_w, BLOCK_D=_BLOCK_D)
    return out_ND


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, order_M, inv_M, k: int):
        ctx.save_for_backward(inv_M)
        ctx.k = k
        return x_ND.index_select(0, order_M // k)

    @staticmethod
    def backward(ctx, g_MD):
        (inv_M,) = ctx.saved_tensors
        return _gather_sum(g_MD, None, inv_M, ctx.k, False), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_MD, w_M, order_M, inv_M, k: int, round_w: bool):
        out_MD = out_MD.contiguous()
        ctx.save_for_backward(out_MD, w_M, order_M)
        ctx.k, ctx.round_w = k, round_w
        return _gather_sum(out_MD, w_M, inv_M, k, round_w)

    @staticmethod
    def backward(ctx, g_ND):
        out_MD, w_M, order_M = ctx.saved_tensors
        M, D = out_MD.shape
        g_out = torch.empty_like(out_MD)
        g_w = torch.empty_like(w_M)
        _combine_backward_kernel[(M,)](g_ND.contiguous(), out_MD, w_M, order_M, g_out, g_w, D, K=ctx.k,
                                       ROUND_W=ctx.round_w, BLOCK_D=_BLOCK_D)
        return g_out, g_w, None, None, None, None


def dispatch(x_ND: torch.Tensor, order_M: torch.Tensor, inv_M: torch.Tensor, k: int) -> torch.Tensor:
    """x_ND's rows copied to the expert-sorted copies: row m is token order[m] // k."""
    return _Dispatch.apply(x_ND, order_M, inv_M, k)


def combine(out_MD: torch.Tensor, w_M: torch.Tensor, order_M: torch.Tensor, inv_M: torch.Tensor, k: int,
            round_w: bool) -> torch.Tensor:
    """[N, hidden]: each token's k expert outputs (sorted rows of out_MD) weighted by w_M (fp32, [N x k] in
    token order) and summed; round_w rounds each weight to the outputs' dtype before its product."""
    assert w_M.dtype == torch.float32 and w_M.is_contiguous(), "the router's weights are fp32, [N x k]"
    return _Combine.apply(out_MD, w_M, order_M, inv_M, k, round_w)


# CUDA's limit on a grid's second dimension: an expert's blocks of _BLOCK_ACC elements
_MAX_BLOCKS = 65_535


def accumulates(acc_EOI: torch.Tensor, g_EOI: torch.Tensor) -> bool:
    """Whether accumulate_expert_grads serves: both contiguous, an fp32 sink, and an expert's matrix within the
    grid's reach (268 M elements; Mixtral-8x22B's gate/up stack is 201 M an expert)."""
    return (acc_EOI.is_contiguous() and g_EOI.is_contiguous() and acc_EOI.dtype == torch.float32
            and triton.cdiv(acc_EOI[0].numel(), _BLOCK_ACC) <= _MAX_BLOCKS)


def accumulate_expert_grads(acc_EOI: torch.Tensor, g_EOI: torch.Tensor, counts_E: torch.Tensor) -> None:
    """acc_EOI (fp32) += g_EOI for every expert with tokens (counts_E[e] > 0), in one pass."""
    assert accumulates(acc_EOI, g_EOI), "contiguous, an fp32 sink, an expert within the grid (moe_kernels.accumulates)"
    E = acc_EOI.shape[0]
    per_expert = acc_EOI[0].numel()
    _accumulate_kernel[(E, triton.cdiv(per_expert, _BLOCK_ACC))](acc_EOI, g_EOI, counts_E, per_expert,
                                                                 BLOCK=_BLOCK_ACC)
