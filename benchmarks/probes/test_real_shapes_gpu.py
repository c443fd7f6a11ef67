"""Every family at its real layer width and expert count on CUDA, two layers deep at random init: the kernels
real models take (torch's grouped GEMM for the experts with and without stacked adapters, Liger's kernels at
real widths, cuDNN attention at real head sizes, soft-capping, the cross-entropy over several vocabulary
blocks, sliding windows shorter than the sequence) against an fp32 reference on the same device (compute in
fp32, torch kernels, the experts one GEMM each: none of the fast paths), which the tiny tests pin to the CPU path
and the CPU path to HF.

Tolerances, bf16 against fp32 from the same initial weights over the same batch (two steps): the loss to
rel 5e-3, the global gradient norm to rel 5e-2, and each trained unit's change over the two steps to a
relative error (its norm against the reference's) of 0.1. AdamW runs with lr 1 and eps 1, so that a step
moves each weight by m_hat / (sqrt(v_hat) + 1), about its gradient: the change is the gradient, in
proportion, and a wrong gradient in any large tensor of a unit moves it far past 0.1. (With the usual eps a
step moves every weight by about lr with its gradient's sign, and the signs of gradients at the level of bf16
roundoff, the attention's q and k at random init, differ between the runs.) Vocabulary 65,536 (more than one
32,768-wide block of Liger's cross-entropy): the embedding is not what these tests are about.

Not in tests/gpu yet (run it by name: python3 -m pytest -m gpu benchmarks/probes/test_real_shapes_gpu.py). On the
H200 at commit 35a312d every LoRA row, the dense families' too, missed: the first step's loss differed from
the fp32 reference's by 5e-4 to 1e-2 relative, the gradient norm by 1 % (Qwen3) to 2x (Mixtral), and the
adapters' change over two steps was uncorrelated with the reference's (relative error 1.1-1.7), where on the CPU
the same comparison at 1024 wide agrees to 1 %. Until that is understood (an init or update path of the CUDA
LoRA engine that differs between the fp32 and the bf16 run, or a real error), it is a probe, not a gate.
"""

import gc
import time

import pytest
import torch

from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from horizon_ray.engine.model import ModelConfig, family_projections
from tests.tiny import random_batches

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only to be deselected
    pytest.skip("needs CUDA", allow_module_level=True)

V = 65_536
# Tokens of a sequence: past every family's sliding window (Gemma 2's 4,096 the widest), so that the windows' masks
# are what the sliding layers run.
T = 4608
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
              "sliding_window": None, "tie_word_embeddings": False}


def _config(name: str) -> dict:
    """The HF config of a family's real shape, 2 layers, vocabulary V: a planner preset, or Mistral 7B's
    widths (the only Mistral preset is 123B wide)."""
    cfg = dict(MISTRAL_7B) if name == "mistral-7b" else hf_config(resolve_shape(name))
    cfg.update(num_hidden_layers=2, vocab_size=V, initializer_range=0.02)
    for key in ("layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(key, None)
    if cfg["model_type"] == "gemma3_text":
        cfg["sliding_window_pattern"] = 2  # a sliding layer, then a global one
    return cfg


# One real shape per family (Phi-3 and Phi-4 share a layout; Phi-4's LoRA rides along, its base frozen).
# The mixtures of experts first: their grouped GEMMs are what the tiny tests never reached.
FULL = ["olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-2-2b", "gemma-3-4b", "phi-3-mini", "qwen3-4b",
        "llama-3.2-3b", "qwen2.5-7b", "mistral-7b"]
LORA = FULL + ["phi-4"]


def _decisive_routers(eng):
    """Routers at N(0, 1): every token's top-k is clear, so roundoff between bf16 and fp32 cannot flip a routing
    decision (a flip is discrete: no tolerance would hold it)."""
    g = torch.Generator().manual_seed(11)
    for unit in eng.store.units:
        views = unit.layout.views(unit.master)
        if "router" in views:
            views["router"].copy_(torch.randn(views["router"].shape, generator=g))
            eng.store.refresh_wire(unit)


def _train(cfg: dict, dtype: str, kernels: str, lora: LoraConfig | None = None, update: str = "exact"):
    """(losses, first step's gradient norm, each trained unit's change over the steps in bf16, engine stats)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    t = time.perf_counter()
    eng = Engine.from_config(cfg, EngineConfig(lr=1.0, eps=1.0, weight_decay=0.0, device="cuda",
                                               compute_dtype=dtype, kernels=kernels, seed=0, lora=lora,
                                               update=update, max_grad_norm=1e9))
    _decisive_routers(eng)
    before = [u.master.float().clone() for u in eng.store.trained]
    (batch,) = random_batches(1, 1, B=1, T=T, prompt=4, vocab=V)
    losses, norms = [], []
    for _ in range(2):  # the same batch twice: delayed's second step then sees the initial weights again
        losses.append(eng.train_step(batch))
        norms.append(eng.last_grad_norm)
    eng.synchronize()
    deltas = [(u.master.float() - b).bfloat16() for u, b in zip(eng.store.trained, before)]
    stats = eng.stats()
    eng.close()
    del eng, before
    gc.collect()
    torch.cuda.empty_cache()
    print(f"{cfg['model_type']} {dtype} {kernels} {update} lora={lora is not None}: {time.perf_counter() - t:.1f} s")
    return losses, norms[0], deltas, stats


def _errors(got, want) -> list[float]:
    """Each unit's ||got - want|| / ||want||."""
    return [float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)) for g, w in zip(got, want)]


def _assert_close_to_reference(got, ref):
    (lg, ng, dg, _), (lr, nr, dr, _) = got, ref
    errors = _errors(dg, dr)
    print(f"losses {lg} vs {lr}, grad norm {ng:.5g} vs {nr:.5g}, units' relative errors "
          f"{[round(e, 4) for e in errors]}")
    assert lg == pytest.approx(lr, rel=5e-3)
    assert ng == pytest.approx(nr, rel=5e-2)
    assert max(errors) <= 0.1, errors


@pytest.mark.parametrize("name", LORA)
def test_lora_at_real_width_matches_fp32(name):
    """Every projection of the family, the experts' stacked adapters included (r 16: multiples of 8, the grouped
    GEMM's path)."""
    cfg = _config(name)
    lora = LoraConfig(r=16, alpha=32, targets=tuple(family_projections(ModelConfig.load(cfg))))
    ref = _train(cfg, "float32", "torch", lora)
    _assert_close_to_reference(_train(cfg, "bfloat16", "auto", lora), ref)


@pytest.mark.parametrize("name", FULL)
def test_full_exact_at_real_width_matches_fp32(name):
    cfg = _config(name)
    ref = _train(cfg, "float32", "torch")
    _assert_close_to_reference(_train(cfg, "bfloat16", "auto"), ref)


@pytest.mark.parametrize("name", ["qwen3-4b", "olmoe-1b-7b"])
def test_update_modes_at_real_width(name):
    """speculative without clipping is exact (the same kernels and host arithmetic: to roundoff); delayed's
    second step runs on the initial weights: over the same batch it repeats its first step's loss, where exact's
    second step saw the first update."""
    cfg = _config(name)
    exact = _train(cfg, "bfloat16", "auto")
    spec = _train(cfg, "bfloat16", "auto", update="speculative")
    assert spec[0] == pytest.approx(exact[0], rel=1e-5)
    assert max(_errors(spec[2], exact[2])) <= 1e-4
    assert spec[3].speculated_units > 0
    delayed = _train(cfg, "bfloat16", "auto", update="delayed")
    assert delayed[0][0] == pytest.approx(exact[0][0], rel=1e-5)
    assert delayed[0][1] == pytest.approx(delayed[0][0], rel=1e-5)
    assert exact[0][1] != pytest.approx(exact[0][0], rel=1e-4)  # exact's second step saw the first update
