"""Defaults as a user meets them on every family: LoRA targets that follow the family (the bench, ``plan``,
the job spec and the engine), the Liger peers called with the arguments each family's patch takes, PEFT's
peers adapting the experts they are asked to, and the one-pass AdamW built before the first step."""

import argparse
import inspect
import sys
import types

import pytest
import torch

from horizon_ray.bench.cli import add_arguments
from horizon_ray.bench.planning import lora_settings
from horizon_ray.bench.shapes import hf_config, resolve_shape
from horizon_ray.planner import Adapters, max_model, plan
from tests.unit.test_planner_families import H200_NODE


def _bench_args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(("shape", "targets"), [
    ("qwen3-30b-a3b", ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]),
    ("phi-3-mini", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("gemma-3-4b", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
])
def test_bench_lora_targets_follow_the_family(shape, targets):
    s = resolve_shape(shape)
    got = lora_settings(_bench_args("--mode", "lora"), "lora", s)
    assert list(got.targets) == targets
    plan(s, method="lora", lora=got)  # the planner takes them: every one is a projection of the family
    named = lora_settings(_bench_args("--lora-targets", "q_proj,v_proj"), "lora", s)
    assert named.targets == ("q_proj", "v_proj")


def test_plan_and_the_spec_default_to_the_familys_targets(capsys):
    from horizon_ray.cli import main
    from horizon_ray.jobspec import LoraSpec

    found = max_model("all", H200_NODE, "lora")  # no targets named: each family's own
    assert not [t for t in found.tried if "refused" in t]
    assert plan("phi-4", method="lora").lora["targets"] == ("qkv_proj",)
    assert plan("qwen3-30b-a3b", method="lora").lora["targets"] == ("q_proj", "v_proj")
    assert LoraSpec().adapters() == Adapters()
    assert main(["plan", "--max-model", "phi", "--method", "lora"]) == 0
    assert "refused" not in capsys.readouterr().out


def test_engine_lora_defaults_to_the_familys_targets(tmp_path):
    from horizon_ray.engine import Engine, EngineConfig, LoraConfig
    from tests.tiny import tiny_phi3

    eng = Engine.from_pretrained(tiny_phi3(tmp_path)[0], EngineConfig(device="cpu", lora=LoraConfig()))
    assert eng.lora.targets == ("qkv_proj",)
    assert any("qkv.lora_A" in k for k in eng.store.adapters[0].layout.views(eng.store.adapters[0].master))
    eng.close()


def _fake_liger(monkeypatch, **patches):
    mod = types.ModuleType("liger_kernel.transformers")
    for name, fn in patches.items():
        setattr(mod, name, fn)
    pkg = types.ModuleType("liger_kernel")
    pkg.transformers = mod
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)


def test_liger_peers_take_each_familys_arguments(monkeypatch):
    """Liger-Kernel 0.8.5's signatures: Gemma's patches take geglu (the old call passed swiglu: TypeError)."""
    from horizon_ray.bench import hf
    from horizon_ray.bench.metrics import Unavailable

    calls = {}

    def apply_liger_kernel_to_gemma3_text(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                                          rms_norm=True, geglu=True, model=None):
        calls["gemma3_text"] = dict(rope=rope, rms_norm=rms_norm, geglu=geglu, flce=fused_linear_cross_entropy,
                                    ce=cross_entropy)

    def apply_liger_kernel_to_qwen3(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                                    rms_norm=True, swiglu=True, model=None):
        calls["qwen3"] = dict(swiglu=swiglu)

    def apply_liger_kernel_to_mixtral(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                                      rms_norm=True, swiglu=True, model=None):
        raise AttributeError("module has no attribute 'MixtralBlockSparseTop2MLP'")

    _fake_liger(monkeypatch, apply_liger_kernel_to_gemma3_text=apply_liger_kernel_to_gemma3_text,
                apply_liger_kernel_to_qwen3=apply_liger_kernel_to_qwen3,
                apply_liger_kernel_to_mixtral=apply_liger_kernel_to_mixtral)
    extra: dict = {}
    hf.apply_liger(resolve_shape("gemma-3-4b"), extra)
    assert calls["gemma3_text"] == dict(rope=True, rms_norm=True, geglu=True, flce=True, ce=False)
    assert extra["liger_kernels"] == ["fused_linear_cross_entropy", "geglu", "rms_norm", "rope"]
    hf.apply_liger(resolve_shape("qwen3-4b"), {})
    assert calls["qwen3"] == dict(swiglu=True)
    with pytest.raises(Unavailable, match="apply_liger_kernel_to_mixtral.*MixtralBlockSparseTop2MLP"):
        hf.apply_liger(resolve_shape("mixtral-8x7b"), {})
    with pytest.raises(Unavailable, match="no apply_liger_kernel_to_olmoe"):
        hf.apply_liger(resolve_shape("olmoe-1b-7b"), {})
    assert set(hf.liger_kwargs(apply_liger_kernel_to_gemma3_text)) <= set(
        inspect.signature(apply_liger_kernel_to_gemma3_text).parameters)


def test_the_peft_liger_peer_keeps_transformers_experts_where_peft_adapts_them(monkeypatch):
    """Liger's SwiGLU on a MoE family swaps the experts module for Liger's fused MoE, under which the PEFT +
    Liger peer made no step in 200-500 s (qwen3-30b-a3b, mixtral-8x7b). Where PEFT adapts the experts, the peer
    patches the rest and says which kernel it left out; the full fine-tuning peer keeps every kernel."""
    from horizon_ray.bench import hf

    calls = []

    def apply_liger_kernel_to_qwen3_moe(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                                        rms_norm=True, swiglu=True, model=None):
        calls.append(swiglu)

    _fake_liger(monkeypatch, apply_liger_kernel_to_qwen3_moe=apply_liger_kernel_to_qwen3_moe)
    shape = resolve_shape("qwen3-30b-a3b")
    adapted: dict = {}
    hf.apply_liger(shape, adapted, adapted_experts=True)
    full: dict = {}
    hf.apply_liger(shape, full)
    assert calls == [False, True]
    assert adapted["liger_kernels"] == ["fused_linear_cross_entropy", "rms_norm", "rope"]
    assert "fused MoE" in adapted["liger_unpatched"]["swiglu"]
    assert "swiglu" in full["liger_kernels"] and "liger_unpatched" not in full


def test_peft_peer_adapts_the_experts_it_is_asked_to():
    """The experts' stacked projections are parameters, not modules: named as target_modules, PEFT matched
    none of them and adapted the attention alone."""
    from horizon_ray.bench import hf

    cfg = hf_config(resolve_shape("qwen3-30b-a3b", layers=1))
    cfg.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64, vocab_size=128)
    small = type(resolve_shape("qwen3-30b-a3b")).load(cfg)
    torch.manual_seed(0)
    model = hf.build_model(small, torch.float32)
    targets = ("q_proj", "experts.gate_up_proj", "experts.down_proj")
    model = hf.peft_lora(model, 4, 8.0, targets)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("experts" in n and "lora_A" in n for n in names), names
    assert any("q_proj.lora_A" in n for n in names)
    from horizon_ray.planner.shapes import adapter_params

    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapter_params(
        Adapters(r=4, targets=targets), small)


def test_one_pass_adamw_is_built_with_the_engine(monkeypatch):
    from horizon_ray.engine import Engine, EngineConfig, cpu_adam
    from tests.tiny import llama_config

    built = []
    monkeypatch.setattr(cpu_adam, "kernel", lambda: built.append(1))
    eng = Engine.from_config(llama_config(2), EngineConfig(device="cpu", compute_dtype="bfloat16"))
    assert built, "the kernel is first asked for in the first step's update"
    eng.close()
    # fp32 compute (bf16 gradients never come): no compiler started in the engine's process or container
    built.clear()
    eng = Engine.from_config(llama_config(2), EngineConfig(device="cpu", compute_dtype="float32"))
    assert not built
    eng.close()
