"""`horizon-ray bench` end to end on the CPU: the tiny shape, every system in its own process, a result
file and RESULTS.md. (Seconds on two cores; the GPU box runs the same code on real shapes.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from horizon_ray.bench.metrics import REQUIRED_KEYS
from horizon_ray.engine import heap

pytestmark = pytest.mark.slow  # seconds each: out of the fast tier (README, Tests)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--shape", "tiny", "--device", "cpu", "--seq", "64", "--micro", "2", "--accum", "1,2", "--warmup", "1",
        "--steps", "1", "--commit", "test"]


def _bench(tmp_path, *extra, module="horizon_ray"):
    argv = [sys.executable, "-m", module] + (["bench"] if module == "horizon_ray" else [])
    out = subprocess.run(argv + TINY + ["--results-dir", str(tmp_path / "results"), *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    files = list((tmp_path / "results").glob("*.json"))
    assert [f.name for f in files] == [files[0].name] and files[0].name.endswith("-cpu-tiny.json")
    return json.loads(files[0].read_text()), (tmp_path / "RESULTS.md").read_text(), out.stdout


def test_bench_cli_on_the_tiny_shape_on_cpu(tmp_path):
    """The default systems of full fine-tuning: horizon-ray and both in-GPU peers; Liger's is skipped on a CPU."""
    runs, md, stdout = _bench(tmp_path)
    assert [(r["system"], r["accum"]) for r in runs] == [
        ("horizon-ray", 1), ("horizon-ray", 2), ("in-gpu-liger", 1), ("in-gpu-liger", 2),
        ("in-gpu-baseline", 1), ("in-gpu-baseline", 2)]
    for r in runs:
        assert set(REQUIRED_KEYS) <= set(r), r["system"]
        assert r["date"] and r["box"] == "cpu" and r["commit"] == "test" and r["device"] == "cpu"
        assert r["tokens_per_step"] == 64 * 2 * r["accum"]
    measured = [r for r in runs if r["system"] != "in-gpu-liger"]
    for r in measured:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["model_tflops"] is not None
        assert r["host_rss_bytes"] > 0 and r["peak_gpu_bytes"] == 0
        base = next(b for b in runs if b["system"] == "in-gpu-baseline" and b["accum"] == r["accum"])
        assert r["baseline_tokens_per_s"] == base["tokens_per_s"] and r["ratio_peer"] == "in-gpu-baseline"
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"], abs=1e-3)
        # the Liger peer ran in this invocation and was skipped: no ratio, and why
        assert r["ratio_liger"] is None and r["liger_tokens_per_s"] is None and r["ratio_liger_peer"] == "in-gpu-liger"
        assert r["ratio_liger_reason"].startswith("in-gpu-liger skipped: Liger-Kernel's kernels are Triton kernels")
    hr = [r for r in runs if r["system"] == "horizon-ray"]
    assert all(r["planned_host_bytes"] > 0 and r["exposed_optimizer_s"] is not None for r in hr)
    # malloc's free lists (glibc's mallinfo2; None elsewhere), to tell freed heap from the plan's buffers
    glibc = heap.free_bytes() is not None
    assert all(r["host_heap_free_bytes"] >= 0 if glibc else r["host_heap_free_bytes"] is None for r in hr)
    for r in hr:  # and the RSS by kind, read at the same moment (a few pages apart)
        parts = r["host_rss_anon_bytes"] + r["host_rss_file_bytes"] + r["host_rss_shmem_bytes"]
        assert r["host_rss_anon_bytes"] > r["store_bytes"]["master"] > 0
        assert abs(parts - r["host_rss_bytes"]) < 16 * 2**20, (parts, r["host_rss_bytes"])
    assert [r["update"] for r in hr] == ["exact", "exact"] and all(r["rollbacks"] == 0 for r in hr)
    assert all(r["kernels"] == "torch" for r in hr)  # the engine's fused kernels are CUDA-only
    assert all(r["planned_host_bytes"] is None and r["update"] is None for r in runs if r["system"] != "horizon-ray")
    skipped = [r for r in runs if r["system"] == "in-gpu-liger"]
    assert all(r["status"] == "skipped" and "GPU" in r["reason"] and r["ratio"] is None for r in skipped)
    assert "horizon-ray (ran on cpu)" in md and "in-gpu-baseline (ran on cpu)" in md
    assert "**skipped**: Liger-Kernel's kernels are Triton kernels for a GPU" in md
    assert "No ratio_liger: in-gpu-liger skipped" in md
    assert "SUMMARY horizon-ray" in stdout


def test_fsdp2_peer_code_runs_on_cpu(tmp_path):
    """--fsdp-on-cpu: the FSDP2 peer's real code (meta init, fully_shard with CPUOffloadPolicy, mixed precision
    policy, activation checkpointing, host AdamW) on a gloo group of one, without a GPU."""
    runs, _, _ = _bench(tmp_path, "--systems", "fsdp2-offload", "--fsdp-on-cpu", module="horizon_ray.bench")
    assert [r["system"] for r in runs] == ["fsdp2-offload"] * 2
    for r in runs:
        assert r["status"] == "ok", r["reason"]
        assert r["tokens_per_s"] > 0 and r["exposed_optimizer_s"] > 0 and r["optimizer"].startswith("AdamW")
        assert r["ratio"] is None  # no baseline in this invocation


def test_lora_mode_trains_adapters_and_is_planned_against_the_peft_peers(tmp_path):
    """--mode lora: the frozen-base engine, and a plan of the same LoRA job to compare host RSS with; its
    default peers are PEFT's (the Liger one skipped on a CPU), with the same adapters."""
    runs, md, _ = _bench(tmp_path, "--mode", "lora", "--lora-r", "4", "--lora-targets", "q_proj,v_proj",
                         "--accum", "2,1")
    assert [(r["system"], r["mode"], r["status"]) for r in runs] == (
        [("horizon-ray", "lora", "ok")] * 2 + [("in-gpu-peft-liger", "lora", "skipped")] * 2
        + [("in-gpu-peft", "lora", "ok")] * 2)
    peft = {r["accum"]: r for r in runs if r["system"] == "in-gpu-peft"}
    for r in runs[:2] + runs[4:]:
        assert r["ratio_peer"] == "in-gpu-peft" and r["baseline_tokens_per_s"] == peft[r["accum"]]["tokens_per_s"]
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / r["baseline_tokens_per_s"], abs=1e-3)
        assert r["ratio_liger"] is None and r["ratio_liger_peer"] == "in-gpu-peft-liger"
        assert "in-gpu-peft-liger skipped: Liger-Kernel" in r["ratio_liger_reason"]
        assert (r["lora_r"], r["lora_alpha"], r["lora_targets"]) == (4, 8.0, ["q_proj", "v_proj"])
    from horizon_ray.bench.shapes import resolve_shape
    from horizon_ray.planner import Adapters, plan
    from horizon_ray.planner.shapes import adapter_params

    tiny = resolve_shape("tiny")
    full = plan(tiny, seq_len=64, micro_batch_size=2, grad_accum=1, checkpoint_every=1,
                compute_dtype="float32", device="cpu")
    lora = Adapters(r=4, targets=("q_proj", "v_proj"))
    for r in peft.values():
        assert r["peak_gpu_bytes"] == 0 and r["exposed_optimizer_s"] > 0 and r["optimizer"].startswith("AdamW")
        # PEFT trained the adapters the horizon-ray row trained, counted as the planner counts them
        assert r["trainable_params"] == adapter_params(lora, tiny)
    assert "in-gpu-peft / in-gpu-peft-liger" in md
    for r in runs[:2]:
        assert r["tokens_per_s"] > 0
        # a LoRA store holds the base once (no master copy, moments or gradient): less than a full fine-tune
        assert 0 < r["planned_host_bytes"] < full.host_bytes - 8 * r["params"]
        # the child trained and was planned with the suite's --lora-r and --lora-targets
        assert r["trainable_params"] == adapter_params(lora, tiny)
        assert r["planned_host_bytes"] == plan(tiny, method="lora", lora=lora, seq_len=64, micro_batch_size=2,
                                               grad_accum=r["accum"], checkpoint_every=1, compute_dtype="float32",
                                               device="cpu", loss_chunk_tokens=1024).host_bytes
        # accumulations run smallest first: each step's RSS is compared with its own plan
        assert (r["rss_plan_host_bytes"], r["rss_plan_tokens_per_step"]) == (r["planned_host_bytes"],
                                                                             r["tokens_per_step"])


def test_lora_on_a_quantized_base_runs_against_peft_bitsandbytes_qlora(tmp_path):
    """--mode lora --quantize nf4: horizon-ray on its packed base, planned with it, against PEFT + bitsandbytes
    QLoRA (the peer's projections are bitsandbytes' Linear4bit), on the CPU."""
    runs, _, _ = _bench(tmp_path, "--mode", "lora", "--lora-r", "4", "--lora-targets", "q_proj,v_proj",
                        "--quantize", "nf4", "--systems", "horizon-ray,in-gpu-peft")
    assert [(r["system"], r["status"], r["quantize"]) for r in runs] == (
        [("horizon-ray", "ok", "nf4")] * 2 + [("in-gpu-peft", "ok", "nf4")] * 2)
    from horizon_ray.bench.shapes import resolve_shape
    from horizon_ray.planner import Adapters, plan

    tiny = resolve_shape("tiny")
    kw = dict(method="lora", seq_len=64, micro_batch_size=2, grad_accum=1, checkpoint_every=1,
              compute_dtype="float32", device="cpu", loss_chunk_tokens=1024)
    nf4 = plan(tiny, lora=Adapters(r=4, targets=("q_proj", "v_proj"), quantize="nf4"), **kw)
    bf = plan(tiny, lora=Adapters(r=4, targets=("q_proj", "v_proj")), **kw)
    assert runs[0]["accum"] == 1 and runs[0]["planned_host_bytes"] == nf4.host_bytes
    assert nf4.breakdown["host"]["weights"] < 0.5 * bf.breakdown["host"]["weights"]
    assert all(r["tokens_per_s"] > 0 for r in runs)
    assert runs[2]["bitsandbytes"] and runs[2]["trainable_params"] == runs[0]["trainable_params"]


def test_quantized_peer_layers_are_bitsandbytes_linear4bit():
    import argparse

    import bitsandbytes as bnb

    from horizon_ray.bench import peft_peer
    from horizon_ray.bench.shapes import resolve_shape

    args = argparse.Namespace(system="in-gpu-peft", checkpoint_every=1)
    model, _, _, _ = peft_peer._prepare_quantized(args, resolve_shape("tiny", layers=2), "cpu", "float32", "nf4", {})
    kinds = {type(m) for n, m in model.named_modules() if n.endswith(("q_proj", "down_proj"))}
    assert kinds == {bnb.nn.Linear4bit} and not any(p.is_meta for p in model.parameters())
    assert type(model.lm_head) is __import__("torch").nn.Linear


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_the_quantized_peer_draws_each_base_weight_once(quantize, monkeypatch):
    """bitsandbytes' layer constructors draw a full fp32 weight that the peer replaces at once: built off the
    meta device they drew a second base on the CPU (minutes for a 70B, which timed the peer out on the H200)."""
    import argparse

    import torch

    from horizon_ray.bench import peft_peer
    from horizon_ray.bench.shapes import resolve_shape

    drawn: dict[int, torch.Tensor] = {}  # by identity: torch's device context calls the init twice for one tensor
    real = torch.nn.init.kaiming_uniform_

    def counting(tensor, *a, **kw):
        if not tensor.is_meta:
            drawn[id(tensor)] = tensor
        return real(tensor, *a, **kw)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", counting)
    args = argparse.Namespace(system="in-gpu-peft", checkpoint_every=1)
    model, _, _, _ = peft_peer._prepare_quantized(args, resolve_shape("tiny", layers=2), "cpu", "float32",
                                                   quantize, {})
    linears = [m for n, m in model.model.layers.named_modules() if n.endswith("_proj")]
    assert len(linears) == 14 and len(drawn) == len(linears), [tuple(t.shape) for t in drawn.values()]
    assert not any(p.is_meta for p in model.parameters())


def test_the_quantized_peer_skips_a_moe_whose_bf16_experts_exceed_the_gpu(monkeypatch):
    """bitsandbytes replaces nn.Linear modules; transformers' MoE experts are 3D parameters and stay bf16. On
    Mixtral-8x22B that is 135 B parameters (252 GiB): the peer said so as ``skipped`` instead of running out of
    memory minutes into a device call."""
    import argparse

    from horizon_ray.bench import peft_peer
    from horizon_ray.bench.metrics import Unavailable
    from horizon_ray.bench.shapes import resolve_shape

    monkeypatch.setattr(peft_peer, "_device_bytes", lambda device: 139 * 2**30)
    args = argparse.Namespace(system="in-gpu-peft", checkpoint_every=1)
    extra: dict = {}
    with pytest.raises(Unavailable, match=r"135\.3 B parameters of mixtral-8x22b unquantized .* 252 GiB in bfloat16"):
        peft_peer._prepare_quantized(args, resolve_shape("mixtral-8x22b"), "cpu", "bfloat16", "nf4", extra)
    assert extra["unquantized_params"] == 56 * 8 * (3 * 6144 * 16384 + 6144)  # the experts and the routers
