"""bfloat16 GEMMs on a CPU without native ones run as float32 GEMMs rounded once (kernels.matmul_mode): torch's
fallback took 33 ms for a 256 x 256 x 704 product that takes 0.9 ms so, and the engine's bf16 CPU steps 12x longer
(tests/unit/test_engine_memory.py's 50 steps: 2.9 s a step, 0.24 s so)."""

import contextlib

import pytest
import torch

from horizon_ray.engine import kernels
from horizon_ray.engine.kernels import matmul_mode

BF16, CPU = torch.bfloat16, torch.device("cpu")


def _wide(*ts):
    return [t.float() for t in ts]


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(kernels, "native_bf16_gemms", lambda: False)


def test_each_bf16_gemm_is_the_float32_gemm_of_its_operands_rounded_once(no_native):
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(BF16)

    a, b, c, bias = r(33, 70), r(70, 41), r(33, 41), r(41)
    x3, y3, z3 = r(3, 9, 70), r(3, 70, 5), r(3, 9, 5)
    want = {
        "mm": (a.float() @ b.float()).to(BF16),
        "addmm": torch.addmm(c.float(), a.float(), b.float(), beta=0.5, alpha=2.0).to(BF16),
        "linear": torch.nn.functional.linear(a.float(), b.float().t(), bias.float()).to(BF16),
        "bmm": torch.bmm(x3.float(), y3.float()).to(BF16),
        "baddbmm": torch.baddbmm(z3.float(), x3.float(), y3.float()).to(BF16),
    }
    with matmul_mode(CPU, BF16):
        got = {"mm": a @ b, "addmm": torch.addmm(c, a, b, beta=0.5, alpha=2.0),
               "linear": torch.nn.functional.linear(a, b.t(), bias), "bmm": torch.bmm(x3, y3),
               "baddbmm": torch.baddbmm(z3, x3, y3)}
        inplace = c.clone().addmm_(a, b)
        out = torch.empty(33, 41, dtype=BF16)
        view = torch.zeros(40, 41, dtype=BF16)[2:35]
        torch.mm(a, b, out=out)
        torch.mm(a, b, out=view)
    for name, t in got.items():
        assert t.dtype == BF16 and torch.equal(t, want[name]), name
    assert torch.equal(inplace, torch.addmm(c.float(), a.float(), b.float()).to(BF16))
    assert torch.equal(out, want["mm"]) and torch.equal(view, want["mm"])
    # float32 operands and mixed ones are torch's own
    with matmul_mode(CPU, BF16):
        assert torch.equal(a.float() @ b.float(), torch.mm(*_wide(a, b)))


def test_the_backward_of_a_bf16_layer_runs_in_the_mode_too(no_native, monkeypatch):
    """autograd runs a CPU backward on the calling thread, inside the mode: its GEMMs take the float32 path."""
    seen = []
    dispatch = kernels._Fp32Matmuls.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        if func in kernels._MATMULS and kernels._bf16_cpu(args):
            seen.append(func)
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(kernels._Fp32Matmuls, "__torch_dispatch__", spy)
    x = torch.randn(8, 16).to(BF16).requires_grad_()
    w = torch.randn(12, 16).to(BF16).requires_grad_()
    with matmul_mode(CPU, BF16):
        torch.nn.functional.linear(x, w).sum().backward()
    assert len(seen) == 3  # the forward, dL/dx and dL/dw
    assert torch.equal(x.grad, (torch.ones(8, 12) @ w.float()).to(BF16))


@pytest.mark.parametrize("device, dtype, native", [("cpu", torch.float32, False), ("cpu", BF16, True),
                                                   ("cuda", BF16, False)])
def test_elsewhere_nothing_changes(device, dtype, native, monkeypatch):
    monkeypatch.setattr(kernels, "native_bf16_gemms", lambda: native)
    assert isinstance(matmul_mode(torch.device(device), dtype), contextlib.nullcontext)


def test_a_bf16_cpu_engine_runs_its_gemms_in_float32(no_native, monkeypatch):
    """train_step, eval_loss, sequence_logps and forward_logits of a bfloat16 engine on such a CPU, and its
    generator's passes."""
    from horizon_ray.engine import Engine, EngineConfig
    from horizon_ray.engine.generate import Generator
    from horizon_ray.engine.sampling import Request, SamplingParams
    from tests.tiny import JOB_LLAMA as TINY_LLAMA

    entered = []
    enter = kernels._Fp32Matmuls.__enter__

    def spy(self):
        entered.append(True)
        return enter(self)

    monkeypatch.setattr(kernels._Fp32Matmuls, "__enter__", spy)
    eng = Engine.from_config(TINY_LLAMA, EngineConfig(device="cpu", compute_dtype="bfloat16", seed=0))
    try:
        ids = torch.randint(3, TINY_LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
        batch = [(ids, ids.clone())]
        loss = eng.train_step(batch)
        eng.synchronize()
        assert len(entered) == 1 and 0 < loss < 20
        eng.eval_loss(batch)
        eng.sequence_logps(batch)
        logits = eng.forward_logits(ids)
        assert len(entered) == 4 and logits.shape == (2, 16, TINY_LLAMA["vocab_size"])
        # generation with the engine's weights: each pass through the layers (a prefill, then a decode step)
        gen = Generator.of_engine(eng)
        gen.decode_graphs = False
        out = gen.generate([Request((5, 6, 7), SamplingParams(max_tokens=2))])
        assert len(out[0].token_ids) == 2 and len(entered) == 6
    finally:
        eng.close()
    f32 = Engine.from_config(TINY_LLAMA, EngineConfig(device="cpu", compute_dtype="float32", seed=0))
    try:
        f32.train_step(batch)
        assert len(entered) == 6  # a float32 engine's GEMMs are torch's own
    finally:
        f32.close()
