"""The plan against the real engine: host RSS growth of one CPU training step of a ~220M-parameter model."""

import threading
import time

import pytest

from horizon_ray.planner import PROCESS_BASELINE_BYTES, NodeSpec, plan

# Llama-style, untied: 12 layers of 12.85M params + 2 x [32000 x 1024] = 219.7M params, 3.5 GB in exact fp32.
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 16,
          "vocab_size": 32000, "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 2048}
SEQ, MICRO, ACCUM = 64, 2, 2


@pytest.mark.slow
def test_cpu_rss_growth_is_within_10_percent_of_the_plan():
    try:
        from horizon_ray.engine import Engine, EngineConfig
    except ImportError as exc:
        pytest.skip(f"horizon_ray.engine does not import yet ({exc}); this test needs the real engine")
    psutil = pytest.importorskip("psutil")
    import torch

    proc = psutil.Process()
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(ACCUM):
        ids = torch.randint(0, CONFIG["vocab_size"], (MICRO, SEQ), generator=gen)
        batches.append((ids, ids.clone()))
    cfg = EngineConfig(device="cpu", compute_dtype="float32", checkpoint_every=1)

    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    rss0 = proc.memory_info().rss  # torch and the engine imported: the process baseline is behind us
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        eng = Engine.from_config(CONFIG, cfg)
        loss = eng.train_step(batches)
        eng.close()  # the update runs in the background
        grown = proc.memory_info().rss - rss0
    finally:
        stop.set()
        sampler.join()
    peak_grown = peak[0] - rss0

    p = plan(CONFIG, device="cpu", compute_dtype="float32", seq_len=SEQ, micro_batch_size=MICRO, grad_accum=ACCUM,
             checkpoint_every=1, loss_chunk_tokens=cfg.loss_chunk_tokens, node=NodeSpec(gpus=0, gpu_mem_bytes=0))
    predicted = p.host_bytes - PROCESS_BASELINE_BYTES["cpu"]
    assert loss == pytest.approx(10.37, abs=0.5)  # ln(32000): a random model
    assert eng.num_params == p.params
    report = eng.memory_report()["host"]
    assert report["master"] == p.breakdown["host"]["master"]
    assert report["moments"] == p.breakdown["host"]["moments"]
    assert report["grads"] + report["wire"] == p.breakdown["host"]["grads"] + p.breakdown["host"]["weights"]
    msg = (f"RSS grew {grown / 2**20:.0f} MiB after the step (peak {peak_grown / 2**20:.0f} MiB); "
           f"the plan says {predicted / 2**20:.0f} MiB: {p.breakdown['host']}")
    assert abs(grown / predicted - 1) <= 0.10, msg
    assert peak_grown <= 1.10 * predicted, msg
    del eng
