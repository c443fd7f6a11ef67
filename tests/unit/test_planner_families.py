"""The planner on the families beyond Llama / Qwen2 / Mistral: units and bytes equal to the engine's, presets
equal to transformers' parameter counts, every expert counted in RAM and PCIe but only the top-k in FLOPs,
verdicts and the largest model of each family on the H200 box."""

import json

import pytest

from horizon_ray.cli import main
from horizon_ray.planner import H200_NODE, PRESETS, Adapters, load_model_shape, max_model, plan
from horizon_ray.planner.timing import flops_params

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
CONFIGS = {
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 24},
    "phi3": {**BASE, "model_type": "phi3"},
    "gemma2": {**BASE, "model_type": "gemma2", "head_dim": 16, "tie_word_embeddings": True},
    "gemma3": {**BASE, "model_type": "gemma3_text", "head_dim": 16, "tie_word_embeddings": True},
    "mixtral": {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**BASE, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "olmoe": {**BASE, "model_type": "olmoe", "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2},
    # layers that differ: a dense one, then MoE ones (with Qwen2-MoE's shared expert)
    "qwen2_moe": {**BASE, "model_type": "qwen2_moe", "num_hidden_layers": 3, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                  "mlp_only_layers": [0]},
    "qwen3_moe_mixed": {**BASE, "model_type": "qwen3_moe", "num_hidden_layers": 4, "head_dim": 16, "num_experts": 8,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2},
}
TARGETS = {"qwen3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
           "gemma2": ("q_proj", "v_proj", "down_proj"), "gemma3": ("k_proj", "up_proj"),
           "mixtral": ("q_proj", "experts.gate_up_proj", "experts.down_proj"),
           "qwen3_moe": ("v_proj", "experts.down_proj"), "olmoe": ("o_proj", "experts.gate_up_proj"),
           "qwen2_moe": ("q_proj", "experts.gate_up_proj"), "qwen3_moe_mixed": ("o_proj", "experts.down_proj")}
JOB = {"seq_len": 16, "micro_batch_size": 2, "grad_accum": 1, "checkpoint_every": 1}


def _state(p):
    h = p.breakdown["host"]
    return {k: h[k] for k in ("weights", "master", "moments", "grads")}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_units_and_store_match_the_engine(family):
    import torch

    from horizon_ray.engine.config import DTYPES, EngineConfig
    from horizon_ray.engine.lora import LoraConfig, adapter_layouts
    from horizon_ray.engine.model import ModelConfig, unit_layouts
    from horizon_ray.engine.store import HostStore

    config = CONFIGS[family]
    mc = ModelConfig.from_hf(config)
    shape = load_model_shape(config)
    assert [(u.name, u.numel) for u in unit_layouts(mc)] == shape.units()
    for precision, dtype in (("exact", "float32"), ("exact", "bfloat16"), ("bf16-state", "bfloat16")):
        ec = EngineConfig(precision=precision, compute_dtype=dtype)
        store = HostStore(unit_layouts(mc), DTYPES[dtype], ec.master_dtype, pin=False)
        got, want = store.bytes_by_kind(), _state(plan(config, mode=precision, compute_dtype=dtype, device="cpu",
                                                      **JOB))
        assert (got["master"], got["moments"]) == (want["master"], want["moments"])
        assert got["grads"] + got["wire"] == want["grads"] + want["weights"]
    lora = LoraConfig(r=4, targets=TARGETS[family], modules_to_save=("norm",))
    store = HostStore(unit_layouts(mc), torch.bfloat16, torch.float32, pin=False,
                      adapter_layouts=adapter_layouts(mc, lora))
    p = plan(config, method="lora", lora=Adapters(r=4, targets=TARGETS[family], modules_to_save=("norm",)),
             compute_dtype="bfloat16", device="cpu", **JOB)
    want = _state(p)
    assert store.bytes_by_kind() == {"master": want["master"], "moments": want["moments"], "grads": want["grads"],
                                     "wire": want["weights"]}
    assert store.trainable_params == p.trainable_params


# (preset, transformers config class): the text model of each family at its real size, on the meta device
MODELS = [("qwen3-0.6b", "Qwen3Config"), ("qwen3-30b-a3b", "Qwen3MoeConfig"), ("gemma-3-1b", "Gemma3TextConfig"),
          ("gemma-3-27b", "Gemma3TextConfig"), ("gemma-2-2b", "Gemma2Config"), ("phi-4", "Phi3Config"),
          ("mixtral-8x7b", "MixtralConfig"), ("olmoe-1b-7b", "OlmoeConfig"), ("qwen1.5-moe-a2.7b", "Qwen2MoeConfig"),
          ("qwen2-57b-a14b", "Qwen2MoeConfig")]


@pytest.mark.parametrize(("name", "config_class"), MODELS)
def test_preset_param_counts_match_transformers(name, config_class):
    import torch
    import transformers
    shape = PRESETS[name]
    hf = shape.to_hf_config()
    cfg = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k not in ("model_type",
                                                                                          "architectures")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    assert load_model_shape(hf).units() == shape.units()  # the preset's config reads back to the same shape


def test_published_sizes_and_the_active_parameters_of_moe():
    billions = {"qwen3-0.6b": 0.596, "qwen3-8b": 8.191, "qwen3-32b": 32.762, "qwen3-30b-a3b": 30.532,
                "qwen3-235b-a22b": 235.094, "phi-4": 14.660, "mixtral-8x7b": 46.703, "mixtral-8x22b": 140.631,
                "olmoe-1b-7b": 6.919, "gemma-3-1b": 1.000, "gemma-2-9b": 9.242, "qwen1.5-moe-a2.7b": 14.316,
                "qwen2-57b-a14b": 57.409}
    for name, b in billions.items():
        assert PRESETS[name].num_params / 1e9 == pytest.approx(b, abs=1e-3), name
    # a token's matmuls use the router and its top-k experts: Mixtral 8x7B's published 12.9B active (the
    # embedding's lookup not counted), Qwen3-30B-A3B's 3.3B (3.0B without the embedding)
    assert flops_params(PRESETS["mixtral-8x7b"]) / 1e9 == pytest.approx(12.75, abs=0.1)
    assert flops_params(PRESETS["qwen3-30b-a3b"]) / 1e9 == pytest.approx(3.04, abs=0.1)
    # Qwen1.5-MoE-A2.7B's 2.7B and Qwen2-57B-A14B's 14B active count the shared expert and the embedding
    assert (flops_params(PRESETS["qwen1.5-moe-a2.7b"]) + PRESETS["qwen1.5-moe-a2.7b"].embed_params) / 1e9 == \
        pytest.approx(2.69, abs=0.01)
    assert (flops_params(PRESETS["qwen2-57b-a14b"]) + PRESETS["qwen2-57b-a14b"].embed_params) / 1e9 == \
        pytest.approx(14.25, abs=0.01)
    dense = PRESETS["qwen3-8b"]
    assert flops_params(dense) == dense.matmul_params + dense.vocab_size * dense.hidden_size


def test_every_expert_is_in_the_host_bytes_and_the_copies_but_only_the_top_k_in_the_flops():
    shape = PRESETS["olmoe-1b-7b"]
    p = plan(shape, seq_len=1024, micro_batch_size=8, grad_accum=1, checkpoint_every=4)
    assert p.params == shape.num_params
    assert p.breakdown["host"]["master"] == 4 * shape.num_params  # fp32 master of all 64 experts
    assert p.timing["h2d_bytes"] >= 2 * (shape.num_params - shape.embed_params)  # every expert crosses
    fewer = plan(load_model_shape({**shape.to_hf_config(), "num_experts_per_tok": 4}), seq_len=1024,
                 micro_batch_size=8, grad_accum=1, checkpoint_every=4)
    assert fewer.breakdown["host"]["master"] == p.breakdown["host"]["master"]
    assert fewer.timing["fwd_flops"] < p.timing["fwd_flops"]


def test_the_largest_model_of_each_family_on_the_h200_box():
    """Exact full fine-tuning and LoRA (r 8 on q and v: PEFT's default targets; qkv_proj for Phi) at 65,536
    tokens a step, K 4, on the 125.9 GiB H200 node."""
    job = {"seq_len": 1024, "micro_batch_size": 8, "grad_accum": 8, "checkpoint_every": 4}
    exact = {fam: max_model(fam, H200_NODE, "exact", **job).shape for fam in
             ("qwen3", "qwen3-moe", "gemma-3", "gemma-2", "phi", "mixtral", "olmoe", "qwen2-moe", "moe", "all")}
    assert {fam: s.name if s else None for fam, s in exact.items()} == {
        "qwen3": "qwen3-8b", "qwen3-moe": None, "gemma-3": "gemma-3-4b", "gemma-2": "gemma-2-2b",
        "phi": "phi-3-mini", "mixtral": None, "olmoe": "olmoe-1b-7b", "qwen2-moe": None, "moe": "olmoe-1b-7b",
        "all": "qwen3-8b"}
    lora = {fam: max_model(fam, H200_NODE, "lora", lora=Adapters(targets=targets), **job).shape.name
            for fam, targets in (("qwen3", ("q_proj", "v_proj")), ("qwen3-moe", ("q_proj", "v_proj")),
                                 ("gemma-3", ("q_proj", "v_proj")), ("phi", ("qkv_proj",)),
                                 ("mixtral", ("q_proj", "v_proj")), ("qwen2-moe", ("q_proj", "v_proj")),
                                 ("moe", ("q_proj", "v_proj")))}
    # (Qwen2-57B-A14B's bf16 base, 115 GB, fits the node's RAM beside its adapters; Mixtral 8x7B is 47B)
    assert lora == {"qwen3": "qwen3-32b", "qwen3-moe": "qwen3-30b-a3b", "gemma-3": "gemma-3-27b", "phi": "phi-4",
                    "mixtral": "mixtral-8x7b", "qwen2-moe": "qwen2-57b-a14b", "moe": "qwen2-57b-a14b"}


def test_lora_targets_a_family_lacks_are_refused_and_skipped_by_max_model(capsys):
    with pytest.raises(ValueError, match="its checkpoint fuses them: target qkv_proj and gate_up_proj"):
        plan("phi-4", method="lora", lora=Adapters(targets=("q_proj", "v_proj")))
    with pytest.raises(ValueError, match="mixture of experts"):
        plan("mixtral-8x7b", method="lora", lora=Adapters(targets=("gate_proj",)))
    found = max_model("all", H200_NODE, "lora", lora=Adapters(targets=("q_proj", "v_proj")))
    refused = [t["model"] for t in found.tried if "refused" in t]
    assert refused == ["phi-3-mini", "phi-4"]
    assert main(["plan", "--max-model", "phi", "--method", "lora", "--lora-targets", "q_proj,v_proj"]) == 1
    assert "refused: lora targets ['q_proj', 'v_proj'] are not projections" in capsys.readouterr().out
    assert main(["plan", "--max-model", "moe", "--method", "lora", "--lora-targets",
                 "q_proj,experts.gate_up_proj,experts.down_proj", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "qwen2-57b-a14b" and out["plan"]["lora"]["targets"][1] == "experts.gate_up_proj"
    # an alternative mode for a full job that does not fit: LoRA with PEFT's default targets for the family
    p = plan("phi-4", mode="exact")
    assert not p.fits and any(a["mode"] == "lora" and a["fits"] for a in p.alternatives)


@pytest.mark.parametrize(("config", "needle"), [
    ({"model_type": "gemma3"}, "vision-language checkpoint"),
    ({"model_type": "phimoe"}, "Phi-3.5-MoE"),
    ({"model_type": "deepseek_v3"}, "DeepSeek-V3"),
    ({"model_type": "falcon"}, "model_type 'falcon' is not supported; supported: "),
])
def test_unsupported_families_are_refused_by_name_without_torch(config, needle):
    with pytest.raises(ValueError, match=needle):
        plan({**BASE, **config})


def test_hub_ids_of_the_new_presets():
    for hub, name in (("Qwen/Qwen3-8B", "qwen3-8b"), ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),
                      ("google/gemma-3-27b-it", "gemma-3-27b"), ("microsoft/phi-4", "phi-4"),
                      ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
                      ("allenai/OLMoE-1B-7B-0924", "olmoe-1b-7b"), ("Qwen/Qwen1.5-MoE-A2.7B-Chat", "qwen1.5-moe-a2.7b"),
                      ("Qwen/Qwen2-57B-A14B-Instruct", "qwen2-57b-a14b")):
        assert load_model_shape(hub) is PRESETS[name], hub


def test_the_registry_imports_only_the_family_it_reads_and_no_torch():
    """A lazily imported registry: reading a Qwen2-MoE config imports its module (and Qwen2's, whose attention
    it shares) and the shared blocks, no other family, and not torch (the planner and the API read it too)."""
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from horizon_ray.models import from_hf\n"
            f"cfg = from_hf(json.loads({json.dumps(json.dumps(CONFIGS['qwen2_moe']))}))\n"
            "print(json.dumps([sorted(m for m in sys.modules if m.startswith('horizon_ray.models.')),\n"
            "                  'torch' in sys.modules, cfg.moe_layers, [u for u in cfg.units()]]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules, torch_loaded, moe_layers, units = json.loads(out)
    assert modules == ["horizon_ray.models.blocks", "horizon_ray.models.config", "horizon_ray.models.hf",
                       "horizon_ray.models.qwen2", "horizon_ray.models.qwen2_moe"]
    assert not torch_loaded and moe_layers == [1, 2]
    # layer 0 dense (attention 4 x 64 x 64 + q/k/v biases, MLP 3 x 64 x 96, two norms); layers 1, 2 the router,
    # 8 experts of width 32, the shared expert of width 48 and its gate
    attn = 2 * 64 * 64 + 2 * 64 * 32 + 64 + 2 * 32 + 2 * 64
    assert units[1] == ["layer.0", attn + 3 * 64 * 96]
    moe = attn + 8 * 64 + 8 * 3 * 64 * 32 + 3 * 64 * 48 + 64
    assert units[2:4] == [["layer.1", moe], ["layer.2", moe]]
