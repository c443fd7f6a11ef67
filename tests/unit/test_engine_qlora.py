"""LoRA on a quantized streamed base (QLoRA) against transformers + bitsandbytes + PEFT on tiny models.

Reference: the tiny checkpoint loaded by transformers with ``BitsAndBytesConfig`` (nf4 / fp4 with double
quantization and block size 64, QLoRA's defaults; ``load_in_8bit`` for int8) on the CPU, compute dtype
float32, wrapped by ``peft.get_peft_model``, trained with ``torch.optim.AdamW`` and ``clip_grad_norm_``
over the adapters. transformers leaves the stacked experts of a MoE layer (not nn.Linear modules) in
float32; the engine quantizes every expert's matrix as bitsandbytes quantizes a weight, so the MoE
reference's experts are bitsandbytes' quantize-then-dequantize of each expert (``quantize_4bit`` /
``int8_vectorwise_quant``), what a per-expert Linear4bit would multiply by.

Tolerance, argued: the packed bytes are equal (asserted first), both sides dequantize them with the same
bitsandbytes kernel into fp32, so both multiply by the same weights; what is left is the order of fp32
sums in the layer (SDPA, the chunked loss), the same as plain LoRA against PEFT: rtol 1e-4 on loss,
gradient norm, every adapter gradient and every adapter weight after 3 steps (accumulation of 2
micro-batches, clipping active on every step), atol 1e-6 on gradients and 1e-5 on weights.
"""

import pytest
import torch
from bitsandbytes import functional as bnbF
from peft import PeftModel
from transformers import BitsAndBytesConfig

from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from horizon_ray.engine.model import packed_layer_bytes
from tests.tiny import (
    V,
    named_tensors,
    peft_reference,
    peft_trainable,
    random_batches,
    reference_step,
    resumed_and_uninterrupted,
    tiny_llama,
    tiny_mixtral,
    tiny_qwen2,
)

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def _bnb_config(quantize):
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


def _bnb_model(cls, path, quantize):
    """transformers + bitsandbytes: the checkpoint quantized as QLoRA users load it (on the CPU, fp32)."""
    return cls.from_pretrained(path, quantization_config=_bnb_config(quantize), device_map="cpu",
                               dtype=torch.float32)


# _inference: bitsandbytes' Linear4bit in eval mode on a CPU with AVX512-BF16 repacks its weights for an inference
# kernel (and refuses in_features that are no multiple of 64); the references run in train mode with dropout 0,
# the QLoRA training path, whose forward is the same function of the weights.


def _roundtrip(w, quantize):
    """bitsandbytes' quantize-then-dequantize of one matrix (what the engine multiplies by)."""
    if quantize == "int8":
        cb, scb, _ = bnbF.int8_vectorwise_quant(w.half())
        return cb.float().mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
    q, st = bnbF.quantize_4bit(w.float().contiguous(), blocksize=64, compress_statistics=True, quant_type=quantize)
    return bnbF.dequantize_4bit(q, st)


def _quantize_experts(model, quantize):
    """The MoE reference: each expert's matrices through bitsandbytes' round trip (transformers keeps them fp32)."""
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(experts, name)
                for e in range(p.shape[0]):
                    if name == "gate_up_proj":  # the checkpoint's gate (w1) and up (w3) are separate matrices
                        W = p.shape[1] // 2
                        p[e, :W] = _roundtrip(p[e, :W], quantize)
                        p[e, W:] = _roundtrip(p[e, W:], quantize)
                    else:
                        p[e] = _roundtrip(p[e], quantize)
    return model


def _engine(path, lora, **kw):
    return Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", compute_dtype="float32", lora=lora, **kw))


def _packed_parts(eng):
    """HF module name -> the engine's packed parts of that weight (views of the store's bytes)."""
    out = {}
    for u, unit in enumerate(eng.store.units):
        packed = eng.store.packed[u]
        if packed is None:
            continue
        for t in unit.layout.tensors:
            kind, where = packed.parts[t.key]
            if kind != "none":
                out[t.name] = {part: unit.master[lo:lo + n] for part, (lo, n) in where.items()}
    return out


@pytest.mark.parametrize("quantize", ["nf4", "fp4", "int8"])
def test_packed_base_is_bitsandbytes_byte_for_byte(tmp_path, quantize):
    path, cls = tiny_qwen2(tmp_path, "base")
    ref = _bnb_model(cls, path, quantize)
    eng = _engine(path, LoraConfig(r=4, alpha=8, targets=ALL, quantize=quantize))
    ours = _packed_parts(eng)
    modules = dict(ref.named_modules())
    assert len(ours) == 7 * 3  # every projection of every layer, nothing else
    for name, parts in ours.items():
        w = modules[name.removesuffix(".weight")].weight
        if quantize == "int8":
            assert torch.equal(parts["cb"].view(torch.int8), w.data.reshape(-1)), name
            assert torch.equal(parts["scb"].view(torch.float32), w.SCB), name
            continue
        st = w.quant_state
        assert st.blocksize == 64 and st.nested and st.quant_type == quantize
        assert torch.equal(parts["codes"], w.data.reshape(-1)), name
        assert torch.equal(parts["absmax"], st.absmax), name
        assert torch.equal(parts["absmax2"][:4 * st.state2.absmax.numel()].view(torch.float32), st.state2.absmax)
        assert torch.equal(parts["offset"][:4].view(torch.float32)[0], st.offset), name
    # what is not quantized (norms, biases) is the checkpoint's, and the host holds the packed bytes only
    for name, want in ref.state_dict().items():
        if name.endswith(("norm.weight", "bias")) and ".layers." in name:
            u = 1 + int(name.split(".layers.")[1].split(".")[0])
            key = next(t.key for t in eng.store.units[u].layout.tensors if t.name == name)
            torch.testing.assert_close(eng.store.packed[u].plain(eng.store.units[u].master, key), want,
                                       rtol=0, atol=0)
    layer_bytes = packed_layer_bytes([(t.name, t.key, t.shape) for t in eng.store.units[1].layout.tensors],
                                     quantize, 4)
    assert eng.store.units[1].master.nbytes == layer_bytes
    dense = 4 * eng.store.units[1].layout.numel
    assert layer_bytes < (0.2 if quantize != "int8" else 0.3) * dense  # vs fp32: ~1/7.5 in 4 bits, ~1/3.5 in int8
    eng.close()


def _train_against_reference(eng, ref, init, steps=3):
    params = peft_trainable(ref)
    max_norm = 0.05  # small enough that clipping is active on every step
    eng.load_adapter(init)
    assert set(named_tensors(eng.store.adapters)) == set(params)
    opt = torch.optim.AdamW(params.values(), **HP)
    clipped = 0
    aux = eng.model.router_aux_coef
    for step, mbs in enumerate(random_batches(steps, micro=2)):
        loss = eng.train_step(mbs)
        ref_loss, ref_norm, ref_grads = reference_step(ref, params, opt, mbs, max_norm, aux_coef=aux)
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert eng.last_grad_norm == pytest.approx(ref_norm, rel=1e-4)
        clipped += ref_norm > max_norm
        eng.synchronize()
        for name, g in named_tensors(eng.store.adapters, "grad").items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"grad {name}, step {step}")
    assert clipped == steps
    for name, p in named_tensors(eng.store.adapters).items():
        torch.testing.assert_close(p, params[name].detach(), rtol=1e-4, atol=1e-5, msg=f"weight {name}")


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
@pytest.mark.parametrize("K", [1, 2])
def test_dense_matches_peft_bitsandbytes_qlora(tmp_path, quantize, K):
    path, cls = tiny_llama(tmp_path, "base")
    lora = LoraConfig(r=4, alpha=8, targets=ALL, quantize=quantize)
    ref, init = peft_reference(_bnb_model(cls, path, quantize), lora, tmp_path)
    eng = _engine(path, lora, max_grad_norm=0.05, checkpoint_every=K)
    _train_against_reference(eng, ref, init)
    # the adapter loads with PEFT on the base quantized the same way and gives the engine's logits
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(9))
    out = eng.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_bnb_model(cls, path, quantize), out).train()  # dropout 0: see _inference
    torch.testing.assert_close(eng.forward_logits(ids), loaded(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5)
    # and on the unquantized base: PEFT's logits there are the engine's with quantize none and this adapter
    plain = PeftModel.from_pretrained(cls.from_pretrained(path).float(), out).eval()
    unquantized = Engine.from_pretrained(out, EngineConfig(device="cpu", compute_dtype="float32"))
    assert unquantized.lora.quantize == "none"
    want = plain(input_ids=ids).logits.float()
    torch.testing.assert_close(unquantized.forward_logits(ids), want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(eng.forward_logits(ids), want, atol=1e-3)  # the quantized base is another base
    unquantized.close()
    eng.close()


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_moe_experts_match_peft_bitsandbytes_qlora(tmp_path, quantize):
    path, cls = tiny_mixtral(tmp_path, "base")
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj", *EXPERTS), quantize=quantize)
    base = _quantize_experts(_bnb_model(cls, path, quantize), quantize)
    ref, init = peft_reference(base, lora, tmp_path, expert_targets=EXPERTS)
    eng = _engine(path, lora, max_grad_norm=0.05)
    # every expert's matrix is packed as bitsandbytes packs it
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
        parts = _packed_parts(eng)[name]
        w = f.get_tensor(name)
    if quantize == "int8":
        assert torch.equal(parts["cb"].view(torch.int8), bnbF.int8_vectorwise_quant(w.half())[0].reshape(-1))
    else:
        q, st = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type=quantize)
        assert torch.equal(parts["codes"], q.reshape(-1)) and torch.equal(parts["absmax"], st.absmax)
    _train_against_reference(eng, ref, init)
    eng.close()


def test_resume_is_exact_and_merged_model_is_dequantized_base_plus_adapter(tmp_path):
    path, cls = tiny_llama(tmp_path, "base")
    lora = LoraConfig(r=4, alpha=8, targets=ALL, quantize="nf4")
    cfg = EngineConfig(**HP, device="cpu", compute_dtype="float32", lora=lora)
    whole, resumed = resumed_and_uninterrupted(path, cfg, random_batches(4, micro=2))
    got = named_tensors(resumed.store.adapters)
    for name, a in named_tensors(whole.store.adapters).items():
        assert torch.equal(a, got[name]), name
    # merged: dequantized W + scaling B A, the model PEFT's merge_and_unload gives on the dequantized base
    merged = Engine.from_pretrained(whole.save_merged(tmp_path / "merged"), EngineConfig(device="cpu",
                                                                                        compute_dtype="float32"))
    adapter = whole.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(3))
    with_adapter = PeftModel.from_pretrained(_bnb_model(cls, path, "nf4"), adapter).train()
    torch.testing.assert_close(merged.forward_logits(ids), with_adapter(input_ids=ids).logits.float(),
                               rtol=1e-4, atol=1e-5)
    merged.close()


@pytest.mark.parametrize("quantize", ["nf4", "fp4", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_expert_stack_dequantizes_in_one_pass_bit_for_bit(quantize, dtype, monkeypatch):
    """A read of a MoE layer dequantized each expert's matrix on its own: 384 bitsandbytes calls a layer of
    Qwen3-30B-A3B (128 experts), 5.5 s of host launches a step on the H200, where the step's GPU work was 1.3 s.
    A stack whose members' parts form runs is now one pass; it equals member by member bit for bit, and widths
    that do not hold whole 4-bit blocks a row keep the member by member path."""
    from horizon_ray.engine import quant

    config = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False,
              "num_local_experts": 16, "num_experts_per_tok": 2}
    eng = Engine.from_config(config, EngineConfig(device="cpu", compute_dtype=dtype,
                                                  lora=LoraConfig(r=4, targets=("q_proj",), quantize=quantize)))
    packed, flat = eng.store.packed[1], eng.store.units[1].wire
    calls = []
    real = quant.PackedLayout.dequantize

    def counted(self, flat, key, out=None):
        calls.append(key)
        return real(self, flat, key, out)

    monkeypatch.setattr(quant.PackedLayout, "dequantize", counted)
    views = packed.views(flat)
    assert not [key for key in calls if key.startswith("experts.")]
    for stack, _, shape in packed.layout.stacks:
        rows = [real(packed, flat, key) for key in packed._members[stack]]
        assert torch.equal(views[stack], torch.cat(rows).view(shape)), stack
    eng.close()
    # intermediate 48: the down projections' rows are not whole 64-weight blocks, the gate and up ones are
    eng = Engine.from_config({**config, "intermediate_size": 48}, EngineConfig(
        device="cpu", compute_dtype=dtype, lora=LoraConfig(r=4, targets=("q_proj",), quantize=quantize)))
    calls.clear()
    eng.store.packed[1].views(eng.store.units[1].wire)
    assert {key.split(".")[-1] for key in calls if key.startswith("experts.")} == (
        set() if quantize == "int8" else {"down"})
    eng.close()


def test_the_plan_knows_the_quantization_chunk():
    from horizon_ray.engine import quant
    from horizon_ray.planner import memory

    assert memory.QUANT_CHUNK == quant._CHUNK


def test_quantize_is_refused_by_name():
    from horizon_ray.errors import BadInput

    with pytest.raises(BadInput, match="nf4"):
        LoraConfig(quantize="nf3").validate()


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_host_bytes_equal_the_plan(quantize, arch):
    from horizon_ray.planner import Adapters, plan

    config = {"model_type": arch, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
    targets = ("q_proj", "v_proj", *(EXPERTS if arch == "mixtral" else ("down_proj",)))
    if arch == "mixtral":
        config.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    for dtype in ("float32", "bfloat16"):
        lora = LoraConfig(r=4, targets=targets, quantize=quantize)
        eng = Engine.from_config(config, EngineConfig(device="cpu", compute_dtype=dtype, lora=lora))
        p = plan(config, method="lora", lora=Adapters(r=4, targets=targets, quantize=quantize),
                 compute_dtype=dtype, device="cpu", seq_len=16, micro_batch_size=2, grad_accum=1, checkpoint_every=1)
        got, want = eng.store.bytes_by_kind(), p.breakdown["host"]
        assert got == {"master": want["master"], "moments": want["moments"], "grads": want["grads"],
                       "wire": want["weights"]}
        unpacked = plan(config, method="lora", lora=Adapters(r=4, targets=targets), compute_dtype=dtype,
                        device="cpu", seq_len=16, micro_batch_size=2, grad_accum=1, checkpoint_every=1)
        assert want["weights"] < unpacked.breakdown["host"]["weights"]
        eng.close()


@pytest.mark.parametrize("name", ["llama-3.1-70b", "mixtral-8x22b"])
def test_a_quantized_base_crosses_pcie_packed(name):
    """The step's copies move the layers as the host holds them: packed. The plan of mixtral-8x22b's nf4 LoRA
    counted them in bf16 (565 GB a step, 'pcie bound' at 10.2 s) where the H200 ran the step in 8.5 s."""
    from horizon_ray.planner import PRESETS, Adapters, plan

    job = dict(method="lora", seq_len=1024, micro_batch_size=16, grad_accum=1, checkpoint_every=1,
               offload_checkpoints=False)
    packed = plan(PRESETS[name], lora=Adapters(quantize="nf4"), **job)
    bf16 = plan(PRESETS[name], lora=Adapters(), **job)
    wire = packed.breakdown["host"]["weights"]  # the host's packed layers, embedding and head
    # every unit crosses in the forward, the layers again in the backward but the top two blocks'
    assert wire < packed.timing["h2d_bytes"] < 2 * wire
    assert packed.timing["h2d_bytes"] < 0.35 * bf16.timing["h2d_bytes"]
    assert packed.timing["fwd_flops"] == bf16.timing["fwd_flops"]


def test_a_128_gib_node_plans_a_base_over_3_3_times_the_bf16_one():
    """The issue's target: plan --max-model all --scan-depth --method lora --quantize nf4 on a 128 GiB node."""
    from dataclasses import replace

    from horizon_ray.planner import H200_NODE, Adapters, max_model, parse_bytes

    node = replace(H200_NODE, ram_bytes=parse_bytes("128GiB"))
    found = {q: max_model("all", node, "lora", scan_depth=True, lora=Adapters(quantize=q)) for q in ("none", "nf4")}
    assert found["none"].shape.num_params > 60e9  # llama-3.1-70b@70L at d681f7c
    assert found["nf4"].shape.num_params >= 3.3 * found["none"].shape.num_params


def test_job_spec_carries_quantize_to_the_engine_and_the_plan():
    from horizon_ray.jobspec import JobSpec
    from horizon_ray.planner import plan_for_spec

    base = {"model": {"path": "llama-3.1-70b"}, "data": {"path": "train.jsonl"}, "method": "lora",
            "output_dir": "runs/x", "training": {"max_steps": 10}}
    plain = JobSpec.from_dict(base)
    nf4 = JobSpec.from_dict({**base, "lora": {"quantize": "nf4"}})
    assert plain.lora.quantize == "none" and nf4.lora.quantize == "nf4"
    assert EngineConfig.from_spec(nf4, device="cpu").lora.quantize == "nf4"
    # the coordinator places a job by this plan's host bytes: a 70B base in nf4 is ~0.26x its bf16 bytes
    ratio = plan_for_spec(nf4).host_bytes / plan_for_spec(plain).host_bytes
    assert 0.2 < ratio < 0.35
    with pytest.raises(ValueError, match="nf4"):
        JobSpec.from_dict({**base, "lora": {"quantize": "q4"}})


def test_openai_create_maps_hyperparameters_quantize_to_a_qlora_spec():
    from api.errors import ApiError
    from api.openai import CreateJob, job_spec

    body = CreateJob(model="m", training_file="file-" + "a" * 24, hyperparameters={"quantize": "nf4"})
    spec = job_spec(body, {"m": "/models/m"})
    assert spec["method"] == "lora" and spec["lora"]["quantize"] == "nf4"
    with pytest.raises(ApiError, match="method lora"):
        job_spec(CreateJob(model="m", training_file="file-" + "a" * 24, hyperparameters={"quantize": "nf4"},
                           spec={"method": "full"}), {"m": "/models/m"})
    with pytest.raises(ValueError):
        CreateJob(model="m", training_file="file-x", hyperparameters={"quantize": "nf3"})


def test_without_bitsandbytes_quantize_names_the_package(monkeypatch):
    import sys

    from horizon_ray.errors import BadInput
    from tests.tiny import llama_config

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(BadInput, match="needs bitsandbytes"):
        Engine.from_config(llama_config(1), EngineConfig(device="cpu", lora=LoraConfig(quantize="nf4")))
