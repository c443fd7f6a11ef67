"""Generation on CUDA against HF generate on the CPU, at a real layer width (run on the GPU box: pytest -m gpu).

A 2-layer model of Llama-7B's layer shape (hidden 4096, 32 heads, 8 kv heads, MLP 11008), random init: in
float32 (TF32 off) the engine's greedy tokens on CUDA equal HF generate's on the CPU, for a left-padded batch of
prompts of different lengths; in bfloat16 the model resident, streamed layer by layer under a small budget and
with its KV cache in pinned host memory give the same tokens (the same kernels on the same bytes), and so do a
resident model's decode steps as CUDA graphs (decode_graphs.py) and as eager steps."""

import pytest
import torch

from horizon_ray.engine.decode_graphs import CAPTURE_AFTER_STEPS
from horizon_ray.engine.generate import Generator
from horizon_ray.engine.sampling import Request, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only to be deselected
    pytest.skip("needs CUDA", allow_module_level=True)

CFG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
       "intermediate_size": 11008, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
       "vocab_size": 32000, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
       "rope_theta": 500000.0, "initializer_range": 0.02}
PROMPTS = [list(range(5, 5 + n)) for n in (40, 7, 129)]


@pytest.fixture(scope="module")
def hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = {k: v for k, v in CFG.items() if k not in ("model_type", "architectures")}
    return LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()


def _tensors(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_greedy_on_cuda_equals_hf_on_the_cpu_in_fp32(hf):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = Generator.from_tensors(CFG, _tensors(hf), device="cuda", dtype="float32", kernels="torch")
    got = gen.generate([Request(tuple(p), SamplingParams(max_tokens=16)) for p in PROMPTS])
    for p, c in zip(PROMPTS, got):
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert c.token_ids == want
    # the decode steps ran as captured CUDA graphs (decode_graphs.py), not the eager fallback
    # (the first CAPTURE_AFTER_STEPS eagerly)
    assert gen._graphs is not None and not gen._graphs.failed and gen._graphs.replays == 15 - CAPTURE_AFTER_STEPS
    assert gen._graphs.captured == 1  # one layout, one bucket
    assert gen._graphs.cache is None and not gen._graphs.steps  # released with the session


def test_calls_that_capture_anew_hold_no_more_gpu_memory(hf):
    """Each call lays out a new cache and captures its decode steps again; the captures share one stream a
    device, so what stays allocated between calls (the weights, cuBLAS's workspace for that stream) is the same
    after the sixth call as after the second. A new stream for each capture left a 32 MiB workspace behind
    per stream it ran cuBLAS on."""
    gen = Generator.from_tensors(CFG, _tensors(hf), device="cuda", dtype="bfloat16")
    reqs = [Request(tuple(p), SamplingParams(max_tokens=CAPTURE_AFTER_STEPS + 4)) for p in PROMPTS]
    held = []
    for _ in range(6):
        gen.generate(reqs)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert gen._graphs is not None and not gen._graphs.failed and gen._graphs.captured == 6
    assert held[-1] <= held[1] + 2**20, [f"{b / 2**20:.1f} MiB" for b in held]


def test_resident_streamed_and_host_kv_agree_in_bf16(hf):
    tensors = _tensors(hf)
    reqs = [Request(tuple(p), SamplingParams(max_tokens=16)) for p in PROMPTS]
    resident = Generator.from_tensors(CFG, tensors, device="cuda", dtype="bfloat16")
    assert resident.resident
    want = [c.token_ids for c in resident.generate(reqs)]
    assert resident._graphs is not None and not resident._graphs.failed
    assert resident._graphs.replays == 15 - CAPTURE_AFTER_STEPS
    # a second call lays out a new cache: its steps are captured anew (the first call's graphs released)
    assert [c.token_ids for c in resident.generate(reqs)] == want
    assert not resident._graphs.failed and resident._graphs.replays == 2 * (15 - CAPTURE_AFTER_STEPS)
    assert resident._graphs.captured == 2
    resident.decode_graphs = False  # the eager steps: the same kernels, launched one by one
    assert [c.token_ids for c in resident.generate(reqs)] == want
    del resident
    layer_bytes = sum(t.numel() for k, t in tensors.items() if k.startswith("model.layers.0.")) * 2
    streamed = Generator.from_tensors(CFG, tensors, device="cuda", dtype="bfloat16",
                                      gpu_budget_bytes=int(4 * layer_bytes))
    assert not streamed.resident
    assert [c.token_ids for c in streamed.generate(reqs)] == want
    streamed.kv_layers_on_device = 1  # the second layer's cache in pinned host memory
    assert [c.token_ids for c in streamed.generate(reqs)] == want


@pytest.mark.parametrize("quantize", ["nf4", "fp4"])
def test_an_adapter_trained_on_a_quantized_base_generates_over_it_on_cuda(tmp_path, quantize):
    """A LoRA trained on CUDA with lora.quantize generates on CUDA over its base quantized the same way (the
    bitsandbytes CUDA kernels, the packed layers resident): the tokens of PEFT over transformers +
    BitsAndBytesConfig on CUDA, in float32 with TF32 off, at hidden 2048. PEFT's side runs the whole sequence
    each step (bitsandbytes then dequantizes and multiplies, as the engine does; one token a row would take its
    gemv kernel). Not int8: on CUDA bitsandbytes' Linear8bitLt multiplies in int8 with outlier columns apart
    (LLM.int8), a different function from the dequantized weights the engine trains and generates with."""
    from peft import PeftModel
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from horizon_ray.engine import Engine, EngineConfig, LoraConfig
    from tests.tiny import random_batches

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=512, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), quantize=quantize)
    eng = Engine.from_pretrained(tmp_path / "base", EngineConfig(lr=1e-2, device="cuda", compute_dtype="float32",
                                                                 lora=lora))
    for mbs in random_batches(2, 1, B=2, T=32, prompt=2, vocab=512):
        eng.train_step(mbs)
    eng.save_pretrained(tmp_path / "adapter")
    eng.close()
    gen = Generator.from_pretrained(tmp_path / "adapter", device="cuda", dtype="float32", tokenizer=None)
    assert gen.store.quantize == quantize and gen.resident
    gen.eos_ids = frozenset()
    prompts = [list(range(5, 5 + n)) for n in (12, 3)]
    got = gen.generate([Request(tuple(p), SamplingParams(max_tokens=8)) for p in prompts])
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize, bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base", quantization_config=bnb, device_map="cuda",
                                            dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    for p, c in zip(prompts, got):
        seq = torch.tensor([p], device="cuda")
        with torch.no_grad():
            for _ in range(8):
                seq = torch.cat([seq, peft(input_ids=seq).logits[0, -1].argmax().view(1, 1)], 1)
        assert c.token_ids == seq[0, len(p):].tolist()
