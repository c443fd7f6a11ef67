"""The plan against the real engine: host RSS growth of one CPU training step of a ~220M-parameter model,
in a fresh process (tests/rss_probe.py)."""

import pytest

from horizon_ray.planner import PROCESS_BASELINE_BYTES, NodeSpec, plan
from tests.rss_probe import measure

pytestmark = pytest.mark.slow  # seconds each: out of the fast tier (README, Tests)

# Llama-style, untied: 12 layers of 12.85M params + 2 x [32000 x 1024] = 219.7M params, 3.5 GB in exact fp32.
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 16,
          "vocab_size": 32000, "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 2048}
SEQ, MICRO, ACCUM = 64, 2, 2


@pytest.mark.slow
def test_cpu_rss_growth_is_within_10_percent_of_the_plan():
    r = measure(CONFIG, {"device": "cpu", "compute_dtype": "float32", "checkpoint_every": 1}, SEQ, MICRO, ACCUM)
    p = plan(CONFIG, device="cpu", compute_dtype="float32", seq_len=SEQ, micro_batch_size=MICRO, grad_accum=ACCUM,
             checkpoint_every=1, loss_chunk_tokens=r["loss_chunk_tokens"], node=NodeSpec(gpus=0, gpu_mem_bytes=0))
    predicted = p.host_bytes - PROCESS_BASELINE_BYTES["cpu"]
    assert r["loss"] == pytest.approx(10.37, abs=0.5)  # ln(32000): a random model
    assert r["num_params"] == p.params
    report = r["host"]
    assert report["master"] == p.breakdown["host"]["master"]
    assert report["moments"] == p.breakdown["host"]["moments"]
    assert report["grads"] + report["wire"] == p.breakdown["host"]["grads"] + p.breakdown["host"]["weights"]
    msg = (f"RSS grew {r['grown'] / 2**20:.0f} MiB after the step (peak {r['peak'] / 2**20:.0f} MiB); "
           f"the plan says {predicted / 2**20:.0f} MiB: {p.breakdown['host']}")
    assert abs(r["grown"] / predicted - 1) <= 0.10, msg
    assert r["peak"] <= 1.10 * predicted, msg
