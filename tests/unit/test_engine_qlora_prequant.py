"""LoRA on a pre-quantized checkpoint: a model directory transformers saved with a bitsandbytes
``quantization_config`` (what the hub's ``*-bnb-4bit`` models are), against PEFT over that directory as
transformers loads it.

The checkpoints are written the way users get them: a tiny model loaded by transformers with
``BitsAndBytesConfig`` on the CPU (quantized by bitsandbytes' CPU backend), then ``save_pretrained``
(bitsandbytes' HF serialization: the codes with ``.absmax``, ``.quant_map``, ``.nested_absmax``,
``.nested_quant_map`` and ``.quant_state.bitsandbytes__<type>`` beside them; int8 rows with ``.SCB``). The bnb
config's compute dtype is float32 so that the reference runs in fp32 like the engine. The byte test uses a
checkpoint quantized from bf16 (the hub's: bf16 norms and a bf16 quant state); the training tests one quantized
from fp32, because over a bf16 quant state bitsandbytes 0.50's MatMul4Bit is not one function of the weights in
fp32: its forward dequantizes into the activations' dtype (fp32), its backward into the state's (bf16) and
casts (the engine dequantizes into the compute dtype, as that forward does; in bf16, on the GPU, both are one).

Tolerances: those of test_engine_qlora.py and for the same reason: the engine's packed bytes are the
checkpoint's (asserted first), both sides dequantize them with bitsandbytes into fp32, so what differs is the
order of fp32 sums.
"""

import json

import pytest
import torch
from bitsandbytes import functional as bnbF
from peft import PeftModel
from safetensors import safe_open
from transformers import BitsAndBytesConfig

from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from horizon_ray.errors import BadInput
from tests.tiny import V, peft_reference, tiny_llama
from tests.unit.test_engine_qlora import ALL, HP, _packed_parts, _train_against_reference

# (lora.quantize, double quantization of the 4-bit scales): QLoRA's nf4, fp4, nf4 without double quantization
# (BitsAndBytesConfig's default use_double_quant=False), LLM.int8
FORMATS = [("nf4", True), ("fp4", True), ("nf4", False), ("int8", False)]
IDS = [f"{q}{'' if nested or q == 'int8' else '-single'}" for q, nested in FORMATS]


def _saved_quantized(tmp_path, quantize, nested, dtype=torch.float32):
    """A tiny Llama saved pre-quantized by transformers + bitsandbytes from ``dtype`` weights; (its directory,
    the model class)."""
    path, cls = tiny_llama(tmp_path, "base")
    if quantize == "int8":
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    else:
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize, bnb_4bit_use_double_quant=nested,
                                 bnb_4bit_compute_dtype=torch.float32)
    cls.from_pretrained(path, quantization_config=bnb, device_map="cpu", dtype=dtype).save_pretrained(
        tmp_path / "quantized")
    return tmp_path / "quantized", cls


def _loaded(cls, qdir):
    """The checkpoint as transformers loads it (its own quantization_config)."""
    return cls.from_pretrained(qdir, device_map="cpu", dtype=torch.float32)


def _engine(qdir, quantize="none", **kw):
    lora = LoraConfig(r=4, alpha=8, targets=ALL, quantize=quantize)
    return Engine.from_pretrained(qdir, EngineConfig(**HP, device="cpu", compute_dtype="float32", lora=lora, **kw))


@pytest.mark.parametrize(("quantize", "nested"), FORMATS, ids=IDS)
def test_stored_bytes_are_taken_as_they_are(tmp_path, quantize, nested):
    qdir, _ = _saved_quantized(tmp_path, quantize, nested, torch.bfloat16)
    config = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes"
    eng = _engine(qdir)  # lora.quantize left at its default: the checkpoint's
    assert eng.lora.quantize == quantize
    ours = _packed_parts(eng)
    assert len(ours) == 7 * 4  # every projection of every layer
    with safe_open(qdir / "model.safetensors", "pt") as f:
        for name, parts in ours.items():
            if quantize == "int8":
                assert torch.equal(parts["cb"].view(torch.int8), f.get_tensor(name).reshape(-1)), name
                assert torch.equal(parts["scb"].view(torch.float32), f.get_tensor(name.removesuffix("weight") + "SCB"))
                continue
            assert torch.equal(parts["codes"], f.get_tensor(name).reshape(-1)), name
            if not nested:
                assert set(parts) == {"codes", "absmax"}  # fp32 scales, kept as they are (no double quantization)
                assert torch.equal(parts["absmax"].view(torch.float32), f.get_tensor(name + ".absmax")), name
                continue
            assert torch.equal(parts["absmax"], f.get_tensor(name + ".absmax")), name
            nested_absmax = f.get_tensor(name + ".nested_absmax")
            assert torch.equal(parts["absmax2"][:4 * nested_absmax.numel()].view(torch.float32), nested_absmax)
            state = json.loads(bytes(f.get_tensor(name + f".quant_state.bitsandbytes__{quantize}").tolist()))
            assert parts["offset"][:4].view(torch.float32).item() == state["nested_offset"], name
        # the norms are the checkpoint's (bf16 on disk), exactly
        norm = f.get_tensor("model.layers.2.input_layernorm.weight")
        assert norm.dtype == torch.bfloat16
        unit = eng.store.units[3]
        key = next(t.key for t in unit.layout.tensors if t.name == "model.layers.2.input_layernorm.weight")
        assert torch.equal(eng.store.packed[3].plain(unit.master, key), norm.float())
    eng.close()


@pytest.mark.parametrize(("quantize", "nested"), FORMATS, ids=IDS)
def test_lora_on_a_prequantized_base_matches_peft(tmp_path, quantize, nested):
    qdir, cls = _saved_quantized(tmp_path, quantize, nested)
    lora = LoraConfig(r=4, alpha=8, targets=ALL, quantize=quantize)
    ref, init = peft_reference(_loaded(cls, qdir), lora, tmp_path)
    eng = _engine(qdir, quantize, max_grad_norm=0.05)  # lora.quantize named, and agreeing
    _train_against_reference(eng, ref, init)
    # the adapter loads with PEFT on the pre-quantized checkpoint and gives the engine's logits
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(9))
    loaded = PeftModel.from_pretrained(_loaded(cls, qdir), eng.save_pretrained(tmp_path / "adapter")).train()
    torch.testing.assert_close(eng.forward_logits(ids), loaded(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5)
    eng.close()


def test_a_quantize_that_disagrees_with_the_checkpoint_names_both_and_the_fix(tmp_path):
    from horizon_ray.planner import Adapters, plan

    qdir, _ = _saved_quantized(tmp_path, "nf4", True)
    with pytest.raises(BadInput, match=r"lora.quantize is int8 but the model is a pre-quantized nf4 checkpoint.*"
                                       r"set lora.quantize to nf4 or leave it out") as exc:
        _engine(qdir, "int8")
    assert exc.value.field == "lora.quantize"
    with pytest.raises(BadInput, match="lora.quantize is fp4 but the model is a pre-quantized nf4"):
        plan(qdir, method="lora", lora=Adapters(quantize="fp4"), device="cpu")


def test_full_fine_tuning_of_a_prequantized_base_is_refused(tmp_path):
    from horizon_ray.planner import plan

    qdir, _ = _saved_quantized(tmp_path, "int8", False)
    with pytest.raises(BadInput, match="pre-quantized int8 checkpoint.*cannot be fine-tuned in full; use method: lora"):
        Engine.from_pretrained(qdir, EngineConfig(device="cpu", compute_dtype="float32"))
    with pytest.raises(BadInput, match="cannot be fine-tuned in full"):
        plan(qdir, method="full", device="cpu")


@pytest.mark.parametrize(("quantize", "nested"), FORMATS, ids=IDS)
def test_the_plan_counts_the_checkpoints_bytes(tmp_path, quantize, nested):
    """plan on the directory: the host bytes the engine holds for it (its packed base), not bf16's."""
    from horizon_ray.planner import format_plan, plan

    qdir, _ = _saved_quantized(tmp_path, quantize, nested)
    kw = dict(method="lora", lora={"r": 4, "targets": list(ALL)}, compute_dtype="float32", device="cpu",
              seq_len=16, micro_batch_size=2, grad_accum=1, checkpoint_every=1)
    p = plan(qdir, **kw)
    eng = _engine(qdir)
    got, want = eng.store.bytes_by_kind(), p.breakdown["host"]
    assert got == {"master": want["master"], "moments": want["moments"], "grads": want["grads"],
                   "wire": want["weights"]}
    unquantized = plan(tmp_path / "base", **kw)
    assert want["weights"] < 0.5 * unquantized.breakdown["host"]["weights"]
    assert f"mode lora, base {quantize}," in format_plan(p) and "mode lora, base" not in format_plan(unquantized)
    eng.close()


def test_a_checkpoint_quantized_otherwise_is_refused_by_name():
    from horizon_ray.planner import plan
    from tests.tiny import llama_config

    config = {**llama_config(2), "quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(BadInput, match="quantized by 'gptq'.*bitsandbytes' 4-bit and 8-bit checkpoints only"):
        plan(config, method="lora", device="cpu")
    with pytest.raises(BadInput, match="quantized by 'gptq'"):
        Engine.from_config(config, EngineConfig(device="cpu", lora=LoraConfig()))


def test_moe_checkpoint_experts_kept_in_floats_are_quantized_as_lora_quantize_does(tmp_path):
    """transformers 5 leaves a MoE's stacked experts (no nn.Linear) in floats in a bnb checkpoint: the engine
    takes the checkpoint's packed attention as it is and quantizes each expert as ``lora.quantize`` does (what
    test_engine_qlora's MoE reference multiplies by)."""
    from tests.tiny import tiny_mixtral
    from tests.unit.test_engine_qlora import EXPERTS, _bnb_config, _quantize_experts

    path, cls = tiny_mixtral(tmp_path, "base")
    qdir = tmp_path / "quantized"
    cls.from_pretrained(path, quantization_config=_bnb_config("nf4"), device_map="cpu",
                        dtype=torch.float32).save_pretrained(qdir)
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj", *EXPERTS), quantize="nf4")
    ref, init = peft_reference(_quantize_experts(_loaded(cls, qdir), "nf4"), lora, tmp_path, expert_targets=EXPERTS)
    eng = Engine.from_pretrained(qdir, EngineConfig(**HP, device="cpu", compute_dtype="float32", max_grad_norm=0.05,
                                                    lora=LoraConfig(r=4, alpha=8, targets=lora.targets)))
    assert eng.lora.quantize == "nf4"
    parts = _packed_parts(eng)
    with safe_open(qdir / "model.safetensors", "pt") as f:
        name = "model.layers.1.self_attn.q_proj.weight"
        assert torch.equal(parts[name]["codes"], f.get_tensor(name).reshape(-1))
        assert torch.equal(parts[name]["absmax"], f.get_tensor(name + ".absmax"))
        expert = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
        assert f.get_tensor(expert).dtype == torch.float32  # stored in floats: quantized by the engine
        q, _ = bnbF.quantize_4bit(f.get_tensor(expert), blocksize=64, compress_statistics=True, quant_type="nf4")
        assert torch.equal(parts[expert]["codes"], q.reshape(-1))
    _train_against_reference(eng, ref, init)
    eng.close()


def test_a_4bit_weight_of_another_block_size_is_dequantized_and_quantized_again(tmp_path):
    """Our 4-bit layout has blocks of 64 (QLoRA's; bitsandbytes on ROCm used 128): a weight stored with other
    blocks is dequantized as bitsandbytes does and quantized into ours, the one load that rounds twice."""
    from safetensors.torch import load_file, save_file

    qdir, _ = _saved_quantized(tmp_path, "nf4", True)
    tensors = load_file(qdir / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    for k in [k for k in tensors if k.startswith(name + ".")]:
        del tensors[k]
    with safe_open(tmp_path / "base" / "model.safetensors", "pt") as f:
        w = f.get_tensor(name)
    codes, state = bnbF.quantize_4bit(w, blocksize=128, compress_statistics=True, quant_type="nf4")
    tensors[name] = codes  # what bitsandbytes' Params4bit saves, its quant state packed beside it
    tensors.update({f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()})
    save_file(tensors, qdir / "model.safetensors", metadata={"format": "pt"})
    eng = _engine(qdir)
    got = _packed_parts(eng)[name]
    want, want_state = bnbF.quantize_4bit(bnbF.dequantize_4bit(codes, state), blocksize=64, compress_statistics=True,
                                          quant_type="nf4")
    assert torch.equal(got["codes"], want.reshape(-1)) and torch.equal(got["absmax"], want_state.absmax)
    other = "model.layers.1.mlp.down_proj.weight"  # the rest still as stored
    with safe_open(qdir / "model.safetensors", "pt") as f:
        assert torch.equal(_packed_parts(eng)[other]["codes"], f.get_tensor(other).reshape(-1))
    eng.close()


def test_the_merged_model_of_a_quantized_base_is_written_in_the_compute_dtype_unless_asked(tmp_path):
    """save_merged on a quantized base: the dequantized base + adapter in the compute dtype (bf16 here, not
    float32, which doubled the files and held no more of the base); save_dtype, when given, still decides."""
    from tests.tiny import random_batches

    qdir, cls = _saved_quantized(tmp_path, "nf4", True, torch.bfloat16)
    merged = {}
    for save_dtype in (None, "float32"):
        eng = Engine.from_pretrained(qdir, EngineConfig(**HP, device="cpu", compute_dtype="bfloat16",
                                                        save_dtype=save_dtype, lora=LoraConfig(r=4, targets=ALL)))
        for mbs in random_batches(2, micro=1):
            eng.train_step(mbs)
        out = eng.save_merged(tmp_path / f"merged-{save_dtype}")
        assert json.loads((out / "config.json").read_text())["dtype"] == (save_dtype or "bfloat16")
        with safe_open(out / "model.safetensors", "pt") as f:
            merged[save_dtype] = {k: f.get_tensor(k) for k in f.keys()}
        eng.close()
    assert {t.dtype for t in merged[None].values()} == {torch.bfloat16}
    assert {t.dtype for t in merged["float32"].values()} == {torch.float32}
    for name, w in merged[None].items():  # the same merge, rounded once to bf16
        assert torch.equal(w, merged["float32"][name].to(torch.bfloat16)), name
    # the merged model is a plain (unquantized) model: its config.json carries no quantization_config
    hf = cls.from_pretrained(tmp_path / "merged-None")
    assert type(hf.model.layers[0].self_attn.q_proj) is torch.nn.Linear and hf.dtype == torch.bfloat16
    plain = Engine.from_pretrained(tmp_path / "merged-None", EngineConfig(device="cpu", compute_dtype="bfloat16",
                                                                          lora=LoraConfig(r=4)))
    assert plain.lora.quantize == "none"
    plain.close()


def test_codes_in_another_quant_storage_dtype_are_read_as_their_bytes(tmp_path):
    """bnb_4bit_quant_storage=bfloat16 (FSDP-QLoRA's checkpoints): the codes are stored as a bf16 tensor."""
    path, cls = tiny_llama(tmp_path, "base")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.bfloat16)
    qdir = tmp_path / "quantized"
    cls.from_pretrained(path, quantization_config=bnb, device_map="cpu", dtype=torch.float32).save_pretrained(qdir)
    eng = _engine(qdir)
    name = "model.layers.2.mlp.gate_proj.weight"
    with safe_open(qdir / "model.safetensors", "pt") as f:
        stored = f.get_tensor(name)
    assert stored.dtype == torch.bfloat16
    assert torch.equal(_packed_parts(eng)[name]["codes"], stored.reshape(-1).view(torch.uint8))
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(4))
    want = _loaded(cls, qdir).train()(input_ids=ids).logits
    torch.testing.assert_close(eng.forward_logits(ids), want, rtol=1e-4, atol=1e-5)
    eng.close()


def test_a_job_spec_on_a_prequantized_directory_is_placed_by_its_packed_bytes(tmp_path):
    """The coordinator places a job by plan_for_spec: lora.quantize left out, the checkpoint's is planned;
    method full is refused before any node is asked."""
    from horizon_ray.jobspec import JobSpec
    from horizon_ray.planner import plan_for_spec

    qdir, _ = _saved_quantized(tmp_path, "nf4", True)
    spec = {"model": {"path": str(qdir)}, "data": {"path": "train.jsonl"}, "method": "lora", "output_dir": "runs/x",
            "training": {"max_steps": 1}}
    quantized = plan_for_spec(JobSpec.from_dict(spec))
    plain = plan_for_spec(JobSpec.from_dict({**spec, "model": {"path": str(tmp_path / "base")}}))
    assert quantized.lora["quantize"] == "nf4" and plain.lora["quantize"] == "none"
    assert quantized.breakdown["host"]["weights"] < 0.5 * plain.breakdown["host"]["weights"]
    with pytest.raises(BadInput, match="cannot be fine-tuned in full"):
        plan_for_spec(JobSpec.from_dict({**spec, "method": "full"}))
