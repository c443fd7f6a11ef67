"""The fused token traffic of a MoE layer (horizon_ray.engine.moe_kernels) against the torch ops it replaces,
at the real layers' widths and top-k (run on the GPU box: pytest -m gpu tests/gpu).

The torch ops are what the CPU path runs and what test_engine_families.py pins against HF; the layer-level
agreement of the fused path (a whole MoE model on CUDA against the CPU) is in test_cuda_real_widths.py.
"""

import pytest
import torch

from horizon_ray.engine.kernels import Kernels, expert_linear

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only to be deselected
    pytest.skip("needs CUDA", allow_module_level=True)

pytest.importorskip("liger_kernel", reason="the fused kernel set needs liger-kernel (and its triton)")

FUSED, TORCH = Kernels("liger"), Kernels("torch")

# (experts, top-k, hidden, HF's fp32 routing product): olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b
WIDTHS = {"olmoe": (64, 8, 2048, False), "qwen3_moe": (128, 8, 2048, False), "mixtral": (8, 2, 4096, True)}


N = 2048  # tokens


def _case(family: str, seed: int, rows: tuple[str, str]):
    """The family's widths, a router's choice for N tokens (k distinct experts each, fp32 weights) and two bf16
    normal tensors of "tokens" (N) or "copies" (N x k) rows: (k, fp32 product, weights, expert of each copy,
    tensors)."""
    E, k, D, fp32_product = WIDTHS[family]
    g = torch.Generator().manual_seed(seed)
    top_e = torch.rand(N, E, generator=g).topk(k, dim=-1).indices
    top_w = torch.rand(N, k, generator=g).softmax(-1)
    tensors = [torch.randn(N * (k if r == "copies" else 1), D, generator=g).cuda().bfloat16() for r in rows]
    return k, fp32_product, top_w.cuda(), top_e.reshape(-1).cuda(), tensors


@pytest.mark.parametrize("family", list(WIDTHS))
def test_fused_dispatch_matches_the_gather_and_sums_its_gradient_in_fp32(family):
    k, _, _, flat_e, (x, gy) = _case(family, 0, ("tokens", "copies"))
    fused, plain = FUSED.moe_routes(flat_e, k), TORCH.moe_routes(flat_e, k)
    assert torch.equal(fused.order_M, plain.order_M) and plain.inv_M is None
    order = fused.order_M
    got_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, ref = FUSED.moe_dispatch(got_x, fused), TORCH.moe_dispatch(ref_x, plain)
    assert torch.equal(got, ref)
    got.backward(gy)
    ref.backward(gy)
    # each token's k copies' gradients summed in fp32 and rounded once: the rounded exact sum, but where the
    # order of the fp32 additions tips a rounding (one bf16 step)
    exact = torch.zeros(N, x.shape[1], device="cuda").index_add_(0, order // k, gy.float())
    got_g = got_x.grad.float()
    torch.testing.assert_close(got_g, exact, rtol=8e-3, atol=1e-6)
    assert (got_g != exact.bfloat16().float()).float().mean() < 1e-3
    torch.testing.assert_close(ref_x.grad.float(), exact, rtol=3e-2, atol=0.1)


@pytest.mark.parametrize("family", list(WIDTHS))
def test_fused_combine_matches_the_torch_ops_forward_and_backward(family):
    k, fp32_product, top_w, flat_e, (out, gy) = _case(family, 1, ("copies", "tokens"))
    fused, plain = FUSED.moe_routes(flat_e, k), TORCH.moe_routes(flat_e, k)
    order = fused.order_M
    leaves = {name: (out.clone().requires_grad_(), top_w.clone().requires_grad_()) for name in ("got", "ref")}
    got = FUSED.moe_combine(*leaves["got"], fused, fp32_product)
    ref = TORCH.moe_combine(*leaves["ref"], plain, fp32_product)
    assert got.shape == (N, out.shape[1]) and got.dtype == torch.bfloat16
    # the same rounded products, summed in fp32 in another order: at most one bf16 step apart
    torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=1e-2)
    assert (got != ref).float().mean() < 0.01
    got.backward(gy)
    ref.backward(gy)
    got_out, got_w = leaves["got"]
    ref_out, ref_w = leaves["ref"]
    # dL/dout: the same product, rounded the same way
    assert torch.equal(got_out.grad, ref_out.grad)
    # dL/dw: the exact dot products in fp32 (torch's rounds every product to bf16 first, then sums)
    token = order // k
    exact_w = torch.empty(N * k, device="cuda")
    exact_w[order] = (gy.float()[token] * out.float()).sum(-1)
    torch.testing.assert_close(got_w.grad.reshape(-1), exact_w, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(ref_w.grad.reshape(-1), exact_w, rtol=2e-2, atol=0.5)


def test_expert_grads_accumulate_where_experts_have_tokens_and_skip_the_rest():
    """The grouped GEMM leaves an empty expert's block unwritten (here: NaN). The fused accumulation skips it and
    adds the others exactly as the unfused fill-then-add does, at olmoe's expert width."""
    from horizon_ray.engine.moe_kernels import accumulate_expert_grads

    g = torch.Generator().manual_seed(2)
    E, O, I = 64, 2048, 2048
    counts = torch.randint(1, 50, (E,), generator=g)
    counts[[3, 40]] = 0
    acc = torch.randn(E, O, I, generator=g).cuda()
    grad = torch.randn(E, O, I, generator=g).cuda().bfloat16()
    grad[[3, 40]] = float("nan")
    want = acc + grad.float()
    want[[3, 40]] = acc[[3, 40]]
    accumulate_expert_grads(acc, grad, counts.cuda())
    assert torch.equal(acc, want)


def test_expert_linear_sinks_the_same_gradient_fused_or_not(monkeypatch):
    """Two backward passes into one fp32 sink, one expert without rows: the fused accumulation (which must be the
    one that ran) leaves the unfused fill-then-add's sink bit for bit, and the empty expert's block stays zero."""
    from horizon_ray.engine import moe_kernels

    calls = []
    real = moe_kernels.accumulate_expert_grads
    monkeypatch.setattr(moe_kernels, "accumulate_expert_grads", lambda *a: (calls.append(1), real(*a)))
    g = torch.Generator().manual_seed(3)
    E, I, O = 8, 512, 1024
    counts = torch.tensor([40, 0, 17, 64, 3, 100, 9, 23]).cuda()
    M = int(counts.sum())
    w = (torch.randn(E, O, I, generator=g) / I**0.5).cuda().bfloat16()
    sinks = {f: torch.zeros(E, O, I, device="cuda") for f in (True, False)}
    for _ in range(2):
        x = torch.randn(M, I, generator=g).cuda().bfloat16()
        gy = torch.randn(M, O, generator=g).cuda().bfloat16()
        for f, sink in sinks.items():
            y = expert_linear(x.clone().requires_grad_(), w, counts, sink, fused=f)
            y.backward(gy)
    assert len(calls) == 2  # the fused sink's two passes, and only those
    assert torch.equal(sinks[True], sinks[False])
    assert not sinks[True][1].any() and sinks[True][0].abs().sum() > 0
