"""Host memory of the engine over many steps, measured in a fresh process (tests/rss_probe.py)."""

import pytest

from tests.rss_probe import measure

pytestmark = pytest.mark.slow  # seconds each: out of the fast tier (README, Tests)

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
          "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "vocab_size": 4000, "tie_word_embeddings": False}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"r": 8, "targets": ["q_proj", "v_proj"], "modules_to_save": ["norm"]}])
def test_host_rss_is_flat_over_50_steps(lora):
    """No step keeps anything: once the first steps have sized every buffer, RSS stays put (the issue's target,
    host RSS flat over 50 steps, on the CPU path: bf16 compute, two micro-batches a step)."""
    r = measure(CONFIG, {"device": "cpu", "compute_dtype": "bfloat16", "checkpoint_every": 2}, seq=64, micro=2,
                accum=2, lora=lora, steps=50)
    after = r["after_each_step"]
    settled, last = after[4], after[-1]
    assert abs(last - settled) <= max(0.02 * settled, 16 * 2**20), [a // 2**20 for a in after]
