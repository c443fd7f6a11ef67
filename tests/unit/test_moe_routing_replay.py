"""A MoE run's routing recorded and replayed (layers.RoutingLog): how a bf16 run is compared with an fp32
reference on a mixture of experts. A near tie between two experts flips with the last bits of the router's
logits, and a flip is discrete, so without the replay the two runs differ by whatever the flipped tokens'
experts differ by. Qwen3-MoE's layout at 256 wide with 32 experts (top 4) and HF's N(0, 0.02) routers, one
sequence of 512 tokens, two steps, on the CPU: 208 of the 4,096 routings (2 steps x 2 layers x forward and
recompute) differ between bf16 and fp32, and each unit's change over the two steps is up to 0.040 from fp32's;
with the fp32 run's routing replayed, 0.011, as far as a dense layer's bf16 roundoff takes it.

AdamW with lr 1 and eps 1, as in tests/gpu/test_cuda_real_widths.py: a step moves each weight about its
gradient, so a unit's change over the steps is its gradients, in proportion.
"""

import pytest

from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.engine import Engine, EngineConfig
from horizon_ray.engine.layers import RoutingLog
from tests.tiny import random_batches

pytestmark = pytest.mark.slow

V, T = 512, 512


def _config() -> dict:
    cfg = hf_config(resolve_shape("qwen3-30b-a3b"))
    cfg.update(num_hidden_layers=2, vocab_size=V, hidden_size=256, moe_intermediate_size=128, intermediate_size=256,
               num_experts=32, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               initializer_range=0.02)
    for key in ("layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(key, None)
    return cfg


def _two_steps(dtype: str, routing: RoutingLog | None, tokens: int = T):
    """(losses, each trained unit's change over two steps on one batch)."""
    eng = Engine.from_config(_config(), EngineConfig(lr=1.0, eps=1.0, weight_decay=0.0, device="cpu",
                                                     compute_dtype=dtype, seed=0, max_grad_norm=1e9))
    eng.template.routing = routing
    before = [u.master.float().clone() for u in eng.store.trained]
    (batch,) = random_batches(1, 1, B=1, T=tokens, prompt=4, vocab=V)
    losses = [eng.train_step(batch) for _ in range(2)]
    eng.synchronize()
    deltas = [u.master.float() - b for u, b in zip(eng.store.trained, before)]
    eng.close()
    return losses, deltas


def _worst(got, want) -> float:
    return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want))


def test_bf16_with_the_fp32_runs_routing_is_as_close_as_roundoff_allows():
    fp32_log, bf16_log = RoutingLog(), RoutingLog()
    _, want = _two_steps("float32", fp32_log)
    _, free = _two_steps("bfloat16", bf16_log)
    assert len(fp32_log.calls) == 8 and all(c.shape == (T, 4) for c in fp32_log.calls)
    flipped = sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
                  for a, b in zip(fp32_log.calls, bf16_log.calls))
    assert 50 <= flipped <= 500, flipped  # a few percent of the 4,096 routings: what the replay is for
    _, replayed = _two_steps("bfloat16", RoutingLog(replay=fp32_log))
    assert _worst(replayed, want) <= 0.02 < _worst(free, want), (_worst(replayed, want), _worst(free, want))


def test_a_replayed_run_repeats_the_recorded_one_and_refuses_another_split():
    log = RoutingLog()
    losses, deltas = _two_steps("float32", log)
    again, replayed = _two_steps("float32", RoutingLog(replay=log))
    assert again[0] == losses[0] and again[1] == pytest.approx(losses[1], rel=1e-6)
    assert _worst(replayed, deltas) <= 1e-5
    with pytest.raises(RuntimeError, match="the runs must split alike"):
        _two_steps("float32", RoutingLog(replay=log), tokens=T // 2)
