"""The experts' grouped GEMM path, run on torch's CPU implementation of F.grouped_mm (the same layout checks
as CUDA's): any operand layout a view can produce, the weight gradients of every expert in one grouped GEMM,
and the routing's counts computed without a host sync."""

import pytest
import torch
import torch.nn.functional as F

from horizon_ray.engine import kernels
from horizon_ray.engine.kernels import expert_linear
from horizon_ray.engine.layers import expert_counts

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    monkeypatch.setattr(kernels, "GROUPED_MM_DEVICES", ("cpu",))


def _stacked_b(O, r, E, g):
    """LoRA's stacked B of the experts as layers._expert_proj views it: [O, r x E] -> [E, O, r], strides
    (1, r E, E): a valid shape in a layout the grouped GEMM refuses as it is."""
    return torch.randn(O, r * E, generator=g).view(O, r, E).permute(2, 0, 1)


def _loop(x, w, counts, gy, sink):
    """The same math, one fp64 GEMM per expert, over the same (bf16-rounded) inputs."""
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    y = torch.cat([xb @ w[e].t() for e, xb in enumerate(x.split(counts.tolist()))])
    gx, gw = torch.autograd.grad(y, [x, w], gy.double())
    return y.detach(), gx, gw, sink.double() + gw


@pytest.mark.parametrize("operand", ["stacked_b", "contiguous"])
def test_grouped_path_takes_any_layout_and_one_gemm_for_the_weight_gradients(grouped_on_cpu, operand):
    g = torch.Generator().manual_seed(0)
    E, r, O = 4, 8, 32
    counts = torch.tensor([5, 0, 9, 2])  # expert 1 gets no rows
    M = int(counts.sum())
    w = _stacked_b(O, r, E, g) if operand == "stacked_b" else torch.randn(E, O, r, generator=g)
    w = w.bfloat16()
    if operand == "stacked_b":
        assert not w.transpose(-2, -1).is_contiguous() and w.stride() == (1, r * E, E)
    x = torch.randn(M, r, generator=g).bfloat16()
    gy = torch.randn(M, O, generator=g).bfloat16()
    sink = torch.randn(E, O, r, generator=g)  # fp32 accumulator: the gradient is added on top
    assert kernels._grouped(x, w)

    x_l, w_l = x.clone().requires_grad_(), w.clone().requires_grad_()
    want_y, want_gx, want_gw, want_sink = _loop(x, w, counts, gy, sink)
    got_sink = sink.clone()
    y = expert_linear(x_l, w_l, counts, got_sink)
    gx, gw = torch.autograd.grad(y, [x_l, w_l], gy)
    tol = dict(rtol=2e-2, atol=2e-2)  # bf16 outputs of fp32-accumulated products
    torch.testing.assert_close(y.double(), want_y, **tol)
    torch.testing.assert_close(gx.double(), want_gx, **tol)
    torch.testing.assert_close(gw.double(), want_gw, **tol)
    torch.testing.assert_close(got_sink.double(), want_sink, **tol)
    assert not gw[1].any() and torch.equal(got_sink[1], sink[1])


def test_the_weight_gradient_loop_is_gone_from_the_grouped_path(grouped_on_cpu, monkeypatch):
    """The backward on the grouped path reads no count on the host (a .tolist() per expert projection was a
    device sync per layer on CUDA)."""
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 4, 0, 1])
    x = torch.randn(8, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(4, 24, 16, generator=g).bfloat16().requires_grad_()
    sink = torch.zeros(4, 24, 16)

    def no_host_read(self):
        raise AssertionError("counts read on the host")

    y = expert_linear(x, w, counts, sink)
    monkeypatch.setattr(torch.Tensor, "tolist", no_host_read)
    torch.autograd.grad(y, [x, w], torch.ones_like(y))


def test_expert_counts_equal_bincount():
    flat_e = torch.randint(0, 16, (1000,), generator=torch.Generator().manual_seed(2))
    flat_e[flat_e == 7] = 3  # an expert nobody chose
    counts = expert_counts(flat_e, 16)
    assert counts.dtype == torch.int64 and counts[7] == 0
    assert torch.equal(counts, torch.bincount(flat_e, minlength=16))
