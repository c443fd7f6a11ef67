"""The dense families at their real layer widths on CUDA, two layers deep at random init: the kernels real models
take (Liger's kernels at real widths, cuDNN attention at real head sizes, soft-capping, the cross-entropy over
several vocabulary blocks, sliding windows shorter than the sequence) against an fp32 reference on the same device
(compute in fp32, torch kernels: none of the fast paths), which the tiny tests pin to the CPU path and the CPU
path to HF. Full fine-tuning and LoRA on every projection of the family.

Tolerances, bf16 against fp32 from the same initial weights over the same batch (two steps): the loss to
rel 5e-3, the global gradient norm to rel 5e-2, and each trained unit's change over the two steps to a
relative error (its norm against the reference's) of 0.1. AdamW runs with lr 1 and eps 1, so that a step
moves each weight by m_hat / (sqrt(v_hat) + 1), about its gradient: the change is the gradient, in
proportion, and a wrong gradient in any large tensor of a unit moves it far past 0.1. (With the usual eps a
step moves every weight by about lr with its gradient's sign, and the signs of gradients at the level of bf16
roundoff, the attention's q and k at random init, differ between the runs.) Vocabulary 65,536 (more than one
32,768-wide block of Liger's cross-entropy): the embedding is not what these tests are about.

On the H200 (2026-12-04) the units' errors were 0.007-0.029 for LoRA and 0.0025-0.029 for full fine-tuning
(benchmarks/probes/results/2026-12-04-h200-real-widths-*.log).

The mixtures of experts (olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b: torch's grouped GEMMs, the experts' stacked
adapters) run with HF's N(0, 0.02) routers, and the bf16 run replays the fp32 run's routing
(``layers.RoutingLog``): without it a few percent of the tokens pick other experts in bf16 than in fp32, as they
do in HF's own model, and the runs part by 0.1-0.3 a unit (benchmarks/probes/test_real_shapes_gpu.py tells the
story). With it, on the H200 at 5f926ee, the units' errors were 0.008-0.016 (olmoe, qwen3-moe) and 0.030-0.040
(mixtral), LoRA and full.
"""

import gc
import time

import pytest
import torch

from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from horizon_ray.engine.layers import RoutingLog
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

# One real shape per dense family (Phi-3 and Phi-4 share a layout; Phi-4's LoRA rides along, its base frozen).
DENSE = ["gemma-2-2b", "gemma-3-4b", "phi-3-mini", "qwen3-4b", "llama-3.2-3b", "qwen2.5-7b", "mistral-7b"]


def real_width_config(name: str) -> dict:
    """The HF config of a family's real shape, 2 layers, vocabulary V: a planner preset, or Mistral 7B's
    widths (the only Mistral preset is 123B wide)."""
    cfg = dict(MISTRAL_7B) if name == "mistral-7b" else hf_config(resolve_shape(name))
    cfg.update(num_hidden_layers=2, vocab_size=V, initializer_range=0.02)
    for key in ("layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(key, None)
    if cfg["model_type"] == "gemma3_text":
        cfg["sliding_window_pattern"] = 2  # a sliding layer, then a global one
    return cfg


def train_two_steps(cfg: dict, dtype: str, kernels: str, lora: LoraConfig | None = None, update: str = "exact",
                    prepare=None):
    """(losses, first step's gradient norm, each trained unit's change over the steps in bf16, engine stats).
    ``prepare(engine)`` may change the initial weights first."""
    torch.backends.cuda.matmul.allow_tf32 = False
    t = time.perf_counter()
    eng = Engine.from_config(cfg, EngineConfig(lr=1.0, eps=1.0, weight_decay=0.0, device="cuda",
                                               compute_dtype=dtype, kernels=kernels, seed=0, lora=lora,
                                               update=update, max_grad_norm=1e9))
    if prepare is not None:
        prepare(eng)
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


def relative_errors(got, want) -> list[float]:
    """Each unit's ||got - want|| / ||want||."""
    return [float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)) for g, w in zip(got, want)]


def assert_close_to_reference(got, ref):
    (lg, ng, dg, _), (lr, nr, dr, _) = got, ref
    errors = relative_errors(dg, dr)
    print(f"losses {lg} vs {lr}, grad norm {ng:.5g} vs {nr:.5g}, units' relative errors "
          f"{[round(e, 4) for e in errors]}")
    assert lg == pytest.approx(lr, rel=5e-3)
    assert ng == pytest.approx(nr, rel=5e-2)
    assert max(errors) <= 0.1, errors


def lora_of(cfg: dict) -> LoraConfig:
    """Every projection of the family, the experts' stacked adapters included (r 16: multiples of 8, the grouped
    GEMM's path)."""
    return LoraConfig(r=16, alpha=32, targets=tuple(family_projections(ModelConfig.load(cfg))))


MOE = ["olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b"]


def routing(log: RoutingLog):
    """prepare(engine) for train_two_steps: the run records its routing into ``log``, or replays the log it was
    given (a dense model never reads it)."""

    def prepare(eng):
        eng.template.routing = log

    return prepare


@pytest.mark.parametrize("name", [*DENSE, "phi-4", *MOE])
def test_lora_at_real_width_matches_fp32(name):
    cfg = real_width_config(name)
    log = RoutingLog()
    ref = train_two_steps(cfg, "float32", "torch", lora_of(cfg), prepare=routing(log))
    assert_close_to_reference(train_two_steps(cfg, "bfloat16", "auto", lora_of(cfg),
                                              prepare=routing(RoutingLog(replay=log))), ref)


@pytest.mark.parametrize("name", [*DENSE, *MOE])
def test_full_exact_at_real_width_matches_fp32(name):
    cfg = real_width_config(name)
    log = RoutingLog()
    ref = train_two_steps(cfg, "float32", "torch", prepare=routing(log))
    assert_close_to_reference(train_two_steps(cfg, "bfloat16", "auto", prepare=routing(RoutingLog(replay=log))), ref)
