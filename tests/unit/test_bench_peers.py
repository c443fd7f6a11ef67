"""The in-GPU peers of the benchmark (HF + Liger-Kernel, HF + PEFT, HF + PEFT + Liger-Kernel), the ratios
against them, and horizon-ray's update modes in one engine process. CPU only, seconds: PEFT's code runs on a
tiny model; Liger-Kernel, which needs a GPU, is recorded skipped with its reason; the engine's update-mode API
is driven through a stand-in engine."""

import argparse
import json
import os
import re
import sys
from pathlib import Path

import pytest

from horizon_ray.bench.child import run_child
from horizon_ray.bench.cli import add_arguments, main
from horizon_ray.bench.metrics import IN_GPU, PEERS, SYSTEMS, Unavailable, base_record, parse_updates, unavailable
from horizon_ray.bench.report import _update_label, compute_ratios, render, write_json
from horizon_ray.bench.shapes import TINY, model_flops_per_token, resolve_shape
from horizon_ray.bench.suite import Child, child_argv, collect, default_systems, spawn

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _run(system, tps, tokens=16384, status="ok", run_id="r1", mode="exact", update=None, **kw):
    rec = base_record(system, TINY, mode=mode, dtype="bfloat16", device="cuda", device_name="NVIDIA H200", seq=1024,
                      micro=tokens // 1024, accum=1, checkpoint_every=1, gpu_budget_bytes=None,
                      flops_per_token=model_flops_per_token(TINY, 1024),
                      update=update or ("exact" if system == "horizon-ray" else None))
    rec.update(status=status, tokens_per_s=tps, step_s=tokens / tps if tps else None, date="2026-12-02", box="h200",
               commit="abc1234", run_id=run_id, command="python -m horizon_ray.bench --shape tiny", **kw)
    return rec


# ---- ratios ---------------------------------------------------------------------------------------------------


def test_full_fine_tuning_rows_carry_both_ratios_and_name_their_peers():
    runs = [_run("horizon-ray", 50.0), _run("horizon-ray", 80.0, update="delayed"), _run("in-gpu-baseline", 100.0),
            _run("in-gpu-liger", 125.0), _run("fsdp2-offload", 25.0)]
    compute_ratios(runs)
    exact, delayed, base, liger, fsdp = runs
    assert (exact["ratio"], exact["ratio_liger"]) == (0.5, 0.4)
    assert (exact["baseline_tokens_per_s"], exact["liger_tokens_per_s"]) == (100.0, 125.0)
    assert (exact["ratio_peer"], exact["ratio_liger_peer"]) == ("in-gpu-baseline", "in-gpu-liger")
    assert exact["ratio_reason"] is None and exact["ratio_liger_reason"] is None
    assert (delayed["ratio"], delayed["ratio_liger"]) == (0.8, 0.64)
    # the peers are held against each other too: Liger's speed-up over plain HF is in its row
    assert (base["ratio"], base["ratio_liger"]) == (1.0, 0.8)
    assert (liger["ratio"], liger["ratio_liger"]) == (1.25, 1.0)
    assert (fsdp["ratio"], fsdp["ratio_liger"]) == (0.25, 0.2)


def test_lora_rows_are_held_against_the_peft_peers_not_the_full_fine_tuning_ones():
    runs = [_run("horizon-ray", 60.0, mode="lora"), _run("in-gpu-peft", 80.0, mode="lora"),
            _run("in-gpu-peft-liger", 120.0, mode="lora"), _run("in-gpu-baseline", 100.0),
            _run("in-gpu-liger", 125.0), _run("horizon-ray", 50.0)]
    compute_ratios(runs)
    lora, peft, peft_liger, full = runs[0], runs[1], runs[2], runs[5]
    assert (lora["ratio"], lora["ratio_peer"], lora["baseline_tokens_per_s"]) == (0.75, "in-gpu-peft", 80.0)
    assert (lora["ratio_liger"], lora["ratio_liger_peer"], lora["liger_tokens_per_s"]) == (
        0.5, "in-gpu-peft-liger", 120.0)
    assert (peft["ratio"], peft["ratio_liger"], peft_liger["ratio"]) == (1.0, 0.667, 1.5)
    assert (full["ratio"], full["ratio_liger"], full["ratio_peer"]) == (0.5, 0.4, "in-gpu-baseline")


def test_ratios_come_only_from_the_same_invocation_and_tokens_per_step():
    runs = [_run("horizon-ray", 50.0, tokens=65536),
            _run("in-gpu-baseline", 100.0), _run("in-gpu-liger", 125.0),  # same invocation, 16,384 tokens a step
            _run("in-gpu-baseline", 200.0, tokens=65536, run_id="r2"),  # 65,536 tokens, another invocation
            _run("in-gpu-liger", 250.0, tokens=65536, run_id="r2")]
    compute_ratios(runs)
    hr = runs[0]
    assert (hr["ratio"], hr["baseline_tokens_per_s"], hr["ratio_liger"], hr["liger_tokens_per_s"]) == (
        None, None, None, None)
    assert hr["ratio_reason"] == "in-gpu-baseline was not run in this invocation at 65,536 tokens per step"
    assert hr["ratio_liger_reason"] == "in-gpu-liger was not run in this invocation at 65,536 tokens per step"


def test_a_peer_that_ran_and_was_not_measured_gives_none_and_its_reason():
    runs = [_run("horizon-ray", 50.0),
            _run("in-gpu-baseline", None, status="did-not-fit", reason="OutOfMemoryError: CUDA out of memory"),
            _run("in-gpu-liger", None, status="skipped", reason="liger_kernel is not importable (x)"),
            _run("horizon-ray", None, status="timeout", reason="killed after 500 s", update="delayed")]
    compute_ratios(runs)
    hr, timed_out = runs[0], runs[3]
    assert hr["ratio"] is None and hr["ratio_liger"] is None
    assert hr["ratio_reason"] == "in-gpu-baseline did-not-fit: OutOfMemoryError: CUDA out of memory"
    assert hr["ratio_liger_reason"] == "in-gpu-liger skipped: liger_kernel is not importable (x)"
    assert timed_out["ratio_reason"] == timed_out["ratio_liger_reason"] == "this run was not measured (timeout)"


# ---- RESULTS.md --------------------------------------------------------------------------------------------


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if re.match(r"\| \d+ \| ", ln)]


def test_results_md_shows_every_system_side_by_side_with_update_and_peers(tmp_path):
    timing = dict(optimizer_update_s=1.0, exposed_optimizer_s=0.1)
    write_json(tmp_path / "2026-12-02-h200-tiny.json", [
        _run("horizon-ray", 95.0, update="speculative", rollbacks=2, **timing),
        _run("horizon-ray", 90.0, update="delayed", rollbacks=0, **timing),
        _run("horizon-ray", 50.0, rollbacks=0, **timing),
        _run("in-gpu-baseline", 100.0),
        _run("in-gpu-liger", None, status="skipped", reason="liger_kernel is not importable (x)"),
        _run("horizon-ray", 60.0, mode="lora", rollbacks=0, **timing),
        _run("in-gpu-peft", 80.0, mode="lora", liger=None, lora_r=16, lora_targets=["q_proj"], peft="0.17.0"),
        _run("in-gpu-peft-liger", 120.0, mode="lora", liger="0.8.5", lora_r=16, lora_targets=["q_proj"]),
    ])
    text = render(tmp_path)
    head = next(ln for ln in text.splitlines() if ln.startswith("| # |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    rows = [dict(zip(cols, r, strict=True)) for r in _table_rows(text)]
    got = [(r["system"], r["mode"].split(",")[0], r["update"], r["ratio"], r["ratio_liger"], r["vs"]) for r in rows]
    assert got == [
        ("horizon-ray", "exact", "exact", "0.500", "—", "in-gpu-baseline / in-gpu-liger"),
        ("horizon-ray", "exact", "delayed", "0.900", "—", "in-gpu-baseline / in-gpu-liger"),
        ("horizon-ray", "exact", "speculative, rolled back", "0.950", "—", "in-gpu-baseline / in-gpu-liger"),
        ("horizon-ray", "lora", "exact", "0.750", "0.500", "in-gpu-peft / in-gpu-peft-liger"),
        ("in-gpu-baseline", "exact", "—", "1.000", "—", "in-gpu-baseline / in-gpu-liger"),
        ("in-gpu-peft", "lora", "—", "1.000", "0.667", "in-gpu-peft / in-gpu-peft-liger"),
        ("in-gpu-peft-liger", "lora", "—", "1.500", "1.000", "in-gpu-peft / in-gpu-peft-liger"),
    ]
    assert "No ratio_liger: in-gpu-liger skipped: liger_kernel is not importable (x)." in text
    assert "No ratio_liger" not in next(ln for ln in text.splitlines() if ln.startswith("- **#4**"))  # LoRA row
    assert "2 speculative updates were rolled back in the timed steps" in text
    # the clipping a speculative run had is in its label (a step after one that clipped runs as exact)
    labels = {norm: _update_label({"system": "horizon-ray", "update": "speculative", "max_grad_norm": norm,
                                   "rollbacks": 0}) for norm in (1.0, 1e9, None)}
    assert labels == {1.0: "speculative, clip at 1", 1e9: "speculative, clipping off", None: "speculative"}
    assert _update_label({"system": "horizon-ray", "update": "speculative", "rollbacks": 2}) == \
        "speculative, rolled back"
    assert _update_label({"system": "horizon-ray", "update": "delayed", "max_grad_norm": 1.0}) == "delayed"
    assert "Liger-Kernel 0.8.5's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy" in text
    assert "in-gpu-peft's whole step" in text  # the LoRA row's time split is held against PEFT's step
    assert "**skipped**: liger_kernel is not importable (x)" in text


def test_a_run_outside_its_plan_says_so_in_the_summary_and_results_md(tmp_path, capsys):
    """The bench runs a step whose plan asks for more GPU memory than the budget (the GPU side of a plan is
    conservative); such a row is marked, and at the allocator's cap its step time is not held to the plan."""
    from horizon_ray.bench.suite import _summary

    gib = 2**30
    reason = "does not fit: GPU memory needs 14.5 GiB but 12.0 GiB are available: 2.5 GiB missing."
    capped = _run("horizon-ray", 40.0, plan_fits=False, plan_reason=reason, gpu_budget_bytes=12 * gib,
                  peak_gpu_reserved_bytes=int(11.99 * gib))
    roomy = _run("horizon-ray", 45.0, update="delayed", plan_fits=False, plan_reason=reason,
                 gpu_budget_bytes=12 * gib, peak_gpu_reserved_bytes=9 * gib)
    inside = _run("horizon-ray", 50.0, update="speculative", plan_fits=True, plan_reason="fits: ...",
                  gpu_budget_bytes=12 * gib, peak_gpu_reserved_bytes=int(11.99 * gib))
    write_json(tmp_path / "2026-12-03-h200-tiny.json", [capped, roomy, inside])
    _summary([capped, roomy, inside], tmp_path / "RESULTS.md")
    plans = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  PLAN ")]
    why = "outside its plan (GPU memory needs 14.5 GiB but 12.0 GiB are available: 2.5 GiB missing)"
    assert plans == [f"  PLAN {why}; it reserved 11.99 GiB of the 12.00 GiB budget, at the allocator's cap, so "
                     "its step time is not the plan's",
                     f"  PLAN {why}; it reserved 9.00 GiB of the 12.00 GiB budget: the plan overstated the GPU "
                     "memory it needed"]
    text = render(tmp_path)
    notes = {ln.split("**")[1]: ln for ln in text.splitlines() if ln.startswith("- **#")}
    assert f"it ran {why}; it reserved 11.99 GiB" in notes["#1"]
    assert "the plan overstated" in notes["#2"]
    assert "outside its plan" not in notes["#3"]


def test_rows_from_before_the_peers_and_update_modes_stay_readable(tmp_path):
    old = _run("horizon-ray", 50.0)
    for key in ("update", "rollbacks", "ratio_peer", "ratio_reason", "liger_tokens_per_s", "ratio_liger",
                "ratio_liger_peer", "ratio_liger_reason"):
        del old[key]
    write_json(tmp_path / "old.json", [old, _run("in-gpu-baseline", 100.0)])
    rows = _table_rows(render(tmp_path))
    assert rows[0][4:8] == ["horizon-ray", "tiny", "exact, ckpt auto", "exact"]  # the engine's only update then
    assert rows[0][11:14] == ["0.500", "—", "in-gpu-baseline / in-gpu-liger"]


# ---- the parent -------------------------------------------------------------------------------------------


def test_default_systems_are_the_peers_of_what_the_modes_train():
    # the strongest peer (Liger-Kernel's) before the plain one: a suite whose time runs out loses the weaker
    # ratio (on the H200 at 0d219b5, three LoRA shapes lost their PEFT + Liger ratio to a 108 s limit)
    assert default_systems(_args()) == ["horizon-ray", "in-gpu-liger", "in-gpu-baseline"]
    assert default_systems(_args("--mode", "lora")) == ["horizon-ray", "in-gpu-peft-liger", "in-gpu-peft"]
    assert default_systems(_args("--mode", "exact,lora")) == ["horizon-ray", *PEERS["full"][::-1],
                                                              *PEERS["lora"][::-1]]
    assert default_systems(_args("--find-largest")) == ["fsdp2-offload", "in-gpu-baseline"]
    assert "fsdp2-offload" in SYSTEMS and set(IN_GPU) < set(SYSTEMS)


def test_what_cannot_run_on_a_cpu_is_skipped_with_a_reason():
    assert "Triton kernels for a GPU" in unavailable("in-gpu-liger", "cpu")
    assert "Triton kernels for a GPU" in unavailable("in-gpu-peft-liger", "cpu")
    assert "FSDP2 CPU offload" in unavailable("fsdp2-offload", "cpu")
    assert unavailable("fsdp2-offload", "cpu", fsdp_on_cpu=True) is None
    assert unavailable("in-gpu-peft", "cpu") is None
    assert all(unavailable(s, "cuda:0") is None for s in SYSTEMS)


def test_update_modes_parse():
    assert parse_updates("exact,delayed,speculative,delayed") == ["exact", "delayed", "speculative"]
    with pytest.raises(ValueError, match="--update takes a comma list of exact, delayed, speculative"):
        parse_updates("exact,lazy")
    assert main(["--update", "lazy", "--report", "--results-dir", "/nonexistent"]) == 2


def test_child_argv_gives_the_update_modes_to_horizon_ray_and_the_adapters_to_peft():
    args = _args("--update", "exact,delayed", "--lora-r", "8", "--lora-targets", "q_proj,v_proj")
    hr = child_argv("horizon-ray", "tiny", args, "cuda", "bfloat16", "exact", "auto")
    assert hr[hr.index("--update") + 1] == "exact,delayed" and "--lora-r" not in hr
    for system in ("in-gpu-peft", "in-gpu-peft-liger"):
        argv = child_argv(system, "tiny", args, "cuda", "bfloat16", None, None)
        assert argv[argv.index("--lora-r") + 1] == "8" and argv[argv.index("--lora-targets") + 1] == "q_proj,v_proj"
        assert "--update" not in argv and "--gpu-budget-gib" not in argv
    liger = child_argv("in-gpu-liger", "tiny", args, "cuda", "bfloat16", None, None)
    assert "--lora-r" not in liger and "--update" not in liger


def test_a_host_update_slower_than_the_step_shows_in_every_timed_step(monkeypatch):
    """Under the delayed update a step waits for the update of the step two before it, so after a drained
    pipeline the first step waits for none and the second only for the tail of an update that ran beside the
    first. With --warmup 1 both timed steps used to be those: a host update longer than the GPU's step was left
    mostly outside the timed steps (olmoe-1b-7b at 16,384 tokens: 0.79 and 1.44 s against a 1.9 s update; here
    0.21 and 0.51 s against 0.64 s). The bench now warms up 1 + 2 x the update's lag steps (the third step trails
    an update begun a whole step before it), so each timed step takes at least about the update."""
    import time as _time

    from horizon_ray.bench import engine_run
    from horizon_ray.engine.optimizer import HostAdamW

    update = HostAdamW.update

    def slow(self, unit, *a, **kw):  # a host update far longer than the tiny model's step
        _time.sleep(0.15)
        return update(self, unit, *a, **kw)

    monkeypatch.setattr(HostAdamW, "update", slow)
    args = _child_args("horizon-ray", "--update", "exact,delayed")
    args.warmup, args.steps = 1, 2
    recs = {r["update"]: r for r in engine_run.run(args, lambda rec: None)}
    # at least the rule's 3; more where a stall of the test's thread left the third step short of the update
    # (settling keeps warming up then: the third step is 4-8 % above its threshold here)
    assert recs["exact"]["warmup_steps"] == 1 and 3 <= recs["delayed"]["warmup_steps"] <= engine_run.MAX_WARMUP
    delayed = recs["delayed"]
    assert delayed["status"] == "ok" and delayed["optimizer_update_s"] > 0.4  # 0.15 s for each of >= 3 units
    # before the rule the first timed step took a third of the update (0.21 against 0.64 s); steady, about all of it
    assert min(delayed["step_times"]) > 0.6 * delayed["optimizer_update_s"], delayed["step_times"]
    assert engine_run.warmup_steps(0, 0) == 1 and engine_run.warmup_steps(4, 1) == 4
    # the tiny model's forward is negligible, so its third step is already as long as the update: the counts
    # above pin the rule; settling keeps warming up while a step is shorter than the update, to a cap
    assert engine_run.settling([1.0, 1.0, 1.0], [1.1, 1.1, 1.1], 1)
    assert not engine_run.settling([1.0, 1.0, 1.05], [1.1, 1.1, 1.1], 1)
    assert not engine_run.settling([1.0, 1.0, 1.0], [1.1, 1.1, 1.1], 0)
    assert not engine_run.settling([0.1] * engine_run.MAX_WARMUP, [1.0] * engine_run.MAX_WARMUP, 1)


def test_a_child_that_died_after_one_update_mode_records_the_others_with_why():
    args = _args("--shape", "tiny", "--accum", "1,2", "--device", "cpu", "--update", "exact,delayed")
    done = _run("horizon-ray", 10.0)
    done["accum"] = 1
    child = Child(lines=["RESULT " + json.dumps(done), "Traceback", "RuntimeError: boom"], returncode=1)
    got = collect(child, "horizon-ray", "tiny", args, "cpu", "float32", "exact", "auto")
    assert [(r["accum"], r["update"], r["status"]) for r in got] == [
        (1, "exact", "ok"), (1, "delayed", "error"), (2, "exact", "error"), (2, "delayed", "error")]
    assert "RuntimeError: boom" in got[1]["reason"] and got[1]["planned_host_bytes"] > 0
    peft = collect(Child(lines=["FAILED " + json.dumps({"status": "skipped", "reason": "peft is not importable"})],
                         returncode=0), "in-gpu-peft", "tiny", args, "cpu", "float32", None, None)
    assert [(r["mode"], r["update"], r["status"], r["reason"]) for r in peft] == [
        ("lora", None, "skipped", "peft is not importable")] * 2
    assert peft[0]["trainable_params"] > 0 and peft[0]["planned_host_bytes"] is None


def test_children_inherit_pythonpath(monkeypatch):
    """The GPU box puts Liger-Kernel's wheel on PYTHONPATH; every child must see it (and the repository)."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    child = spawn([sys.executable, "-c", "import os; print('PP', os.environ['PYTHONPATH'])"], 60, "probe")
    line = next(ln for ln in child.lines if ln.startswith("PP "))
    assert line.split(" ", 1)[1].split(os.pathsep) == [str(ROOT), "/tmp/site"]


def test_a_time_limit_that_runs_out_ends_cleanly_with_every_run_recorded(tmp_path, capsys):
    """No child starts with under 30 s left: each run is recorded not-run, the table is written, exit 0."""
    code = main(["--shape", "tiny", "--device", "cpu", "--seq", "64", "--micro", "2", "--accum", "1,2",
                 "--update", "exact,delayed", "--commit", "test", "--time-limit-s", "1",
                 "--results-dir", str(tmp_path / "results")])
    assert code == 0
    runs = json.loads(next((tmp_path / "results").glob("*.json")).read_text())
    assert [(r["system"], r["accum"], r["update"]) for r in runs] == [
        ("horizon-ray", 1, "exact"), ("horizon-ray", 1, "delayed"), ("horizon-ray", 2, "exact"),
        ("horizon-ray", 2, "delayed"), ("in-gpu-liger", 1, None), ("in-gpu-liger", 2, None),
        ("in-gpu-baseline", 1, None), ("in-gpu-baseline", 2, None)]
    # on the CPU the Liger peer is skipped (no Triton); the rest did not start in the time
    assert [r["status"] for r in runs] == ["not-run"] * 4 + ["skipped"] * 2 + ["not-run"] * 2
    assert "--time-limit-s 1 ran out" in runs[0]["reason"] and runs[0]["ratio_reason"].startswith("this run")
    assert (tmp_path / "RESULTS.md").exists() and "SUMMARY horizon-ray" in capsys.readouterr().out


# ---- the peers' children on the CPU --------------------------------------------------------------------------


def _child_args(system, *extra):
    return _args("--system", system, "--shape", "tiny", "--layers", "2", "--device", "cpu", "--seq", "16",
                 "--micro", "1", "--warmup", "0", "--steps", "1", *extra)


def _failed(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("FAILED "))[len("FAILED "):])


def test_liger_peers_are_skipped_on_a_cpu_and_without_the_package(capsys, monkeypatch):
    for system in ("in-gpu-liger", "in-gpu-peft-liger"):
        assert run_child(_child_args(system)) == 0
        failed = _failed(capsys)
        assert failed["status"] == "skipped" and "Triton kernels for a GPU" in failed["reason"]
    from horizon_ray.bench import hf

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not importable, installed or not
    with pytest.raises(Unavailable, match="liger_kernel is not importable .*benchmarks/README.md"):
        hf.apply_liger(TINY, {})


def test_peft_peers_are_skipped_without_the_package(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    assert run_child(_child_args("in-gpu-peft")) == 0
    failed = _failed(capsys)
    assert failed == {"status": "skipped", "reason": failed["reason"]} and "peft is not importable" in failed["reason"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peft_peer_trains_fp32_adapters_on_a_frozen_base(dtype):
    """The PEFT peer's model and step, on the CPU: a frozen base in the compute dtype, fp32 adapters (as many
    as the planner counts for horizon-ray's LoRA), a bf16 forward under autocast; one step moves the
    adapters and nothing else."""
    import torch

    from horizon_ray.bench import hf
    from horizon_ray.planner import Adapters
    from horizon_ray.planner.shapes import adapter_params
    shape = resolve_shape("tiny", layers=2)
    torch.manual_seed(0)
    model = hf.build_model(shape, getattr(torch, dtype))
    hf.enable_checkpointing(model, 1)
    model = hf.peft_lora(model, 4, 8.0, ("q_proj", "down_proj"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in adapters) and {p.dtype for p in params} == {torch.float32}
    assert {p.dtype for p in frozen.values()} == {getattr(torch, dtype)}
    assert sum(p.numel() for p in params) == adapter_params(Adapters(r=4, targets=("q_proj", "down_proj")), shape)
    opt = hf.FallbackAdamW(params)
    ids = torch.randint(0, shape.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = hf.forward_backward(model, [ids], torch.bfloat16 if dtype == "bfloat16" else None)
    assert torch.isfinite(loss)
    hf.optimizer_step(params, opt)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    moved = [n for n, p in adapters.items() if not torch.equal(after[n], p)]
    assert any("lora_B" in n for n in moved)  # B starts at zero: it moves on the first step


# ---- horizon-ray's update modes in one engine process (a stand-in engine) ----------------------------------


class _Stats:
    def __init__(self):
        self.waited_s, self.last_update_s, self.rollbacks, self.host_checkpoint_bytes = 0.0, 0.0, 0, 0
        self.speculated_units = 0


class _UpdateEngine:
    """What the bench needs of the engine, recording what it was asked: the update mode set at build
    (EngineConfig.update) and by set_update, each train_step's mode and micro-batch count. Each step blocks
    0.25 s on the update (waited_s), and a speculative step rolls back once."""

    log: list = []

    def __init__(self, cfg):
        import torch

        self.update = cfg.update
        self.device = torch.device("cpu")
        self.trainable_params = self.num_params = TINY.num_params
        self.offload_checkpoints = False
        self.template = type("T", (), {"ops": type("K", (), {"name": "torch"})()})()
        self._stats = _Stats()
        self.log.append(("built", cfg.update))

    @classmethod
    def from_config(cls, hf_config, cfg):
        return cls(cfg)

    def set_update(self, mode, speculate_units=None):
        self.log.append(("set_update", mode))
        self.update = mode

    @property
    def update_lag(self):
        return 1 if self.update == "delayed" else 0

    def train_step(self, batches):
        self.log.append(("step", self.update, len(batches)))
        self._stats.waited_s += 0.25
        self._stats.last_update_s = 1.5
        self._stats.rollbacks += self.update == "speculative"
        self._stats.speculated_units = 3 if self.update == "speculative" else 0

    def stats(self):
        return self._stats

    def memory_report(self):
        return {"host": 1, "device": 0}

    def close(self):
        self.log.append(("closed",))


def _engine_args(update, accum="2,1"):
    return _args("--system", "horizon-ray", "--shape", "tiny", "--device", "cpu", "--seq", "16", "--micro", "1",
                 "--accum", accum, "--warmup", "1", "--steps", "2", "--update", update)


def test_one_engine_runs_every_update_mode_inside_each_accumulation(monkeypatch):
    from horizon_ray.bench import engine_run

    monkeypatch.setattr(engine_run, "Engine", _UpdateEngine)
    _UpdateEngine.log = []
    out = []
    engine_run.run(_engine_args("delayed,speculative,exact"), out.append)
    # built once in the first mode; accumulations smallest first, every mode at each (one warm-up; under the
    # delayed update, whose lag is one step, as many as settle it: this engine's instant steps never reach its
    # 1.5 s update, so MAX_WARMUP; two timed; no profiled step on the CPU)
    modes = ("delayed", "speculative", "exact")
    expected = [("built", "delayed")]
    for accum in (1, 2):
        for mode in modes:
            warm = engine_run.MAX_WARMUP if mode == "delayed" else 1
            expected += [("set_update", mode)] + [("step", mode, accum)] * (warm + 2)
    assert _UpdateEngine.log == expected + [("closed",)]
    assert [(r["accum"], r["update"]) for r in out] == [(a, u) for a in (1, 2) for u in modes]
    for r in out:
        assert r["status"] == "ok" and r["exposed_optimizer_s"] == 0.25 and r["optimizer_update_s"] == 1.5
        assert r["rollbacks"] == (2 if r["update"] == "speculative" else 0)  # the timed steps only
        assert r["speculated_units"] == (3 if r["update"] == "speculative" else None)
        # every mode of an accumulation is compared with that accumulation's own plan
        assert (r["rss_plan_host_bytes"], r["rss_plan_tokens_per_step"]) == (r["planned_host_bytes"],
                                                                             r["tokens_per_step"])




FAKE_SMI = """#!/usr/bin/env python3
import sys, time
args = sys.argv[1:]
assert "--query-gpu=clocks.sm,power.draw,temperature.gpu" in args and "--format=csv,noheader,nounits" in args, args
assert "--id=GPU-test" in args and "--loop-ms=200" in args, args
rows = ["1980, 650.5, 60", "[N/A], [N/A], [N/A]", "1755, 700.0, 71", "1830, 680.0, 65"]
for i in range(10_000):
    print(rows[i % len(rows)], flush=True)
    time.sleep(0.01)
"""


def test_gpu_telemetry_samples_the_clock_over_the_timed_steps(tmp_path, monkeypatch, capsys):
    """nvidia-smi's samples of the run's GPU (named by UUID, its own numbering being not CUDA's) become the row's
    clock, power and temperature, unreadable samples skipped; the summary prints them. Without nvidia-smi, or
    off CUDA, there are none and nothing fails."""
    import time

    import torch

    from horizon_ray.bench.runtime import GpuTelemetry
    from horizon_ray.bench.suite import _summary

    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(GpuTelemetry, "_gpu_id", lambda self: "GPU-test")
    t = GpuTelemetry(torch.device("cuda", 0))
    with t:
        deadline = time.monotonic() + 30
        while len(t.samples) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    got = t.summary()
    assert got["gpu_telemetry_samples"] >= 6
    assert got["gpu_sm_clock_min_mhz"] == 1755 and got["gpu_sm_clock_mhz"] in (1830, 1905, 1980)
    assert 650.5 <= got["gpu_power_w"] <= 700.0 and got["gpu_temp_max_c"] == 71
    assert t._proc is not None and t._proc.returncode is not None  # the sampler ended with the block

    row = _run("horizon-ray", 50.0, **got)
    _summary([row], tmp_path / "RESULTS.md")
    gpu = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  GPU ")]
    assert gpu == [f"  GPU SM clock {got['gpu_sm_clock_mhz']:,} MHz (lowest 1,755), {got['gpu_power_w']} W, up to "
                   f"71 C over the timed steps ({got['gpu_telemetry_samples']} samples)"]

    with GpuTelemetry(torch.device("cpu")) as off_cuda:
        pass
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with GpuTelemetry(torch.device("cuda", 0)) as no_smi:
        pass
    assert off_cuda.summary() == {} and no_smi.summary() == {}


def test_gpu_telemetry_names_the_gpu_by_its_uuid(monkeypatch):
    """nvidia-smi's own numbering is not CUDA's (CUDA_VISIBLE_DEVICES renumbers): the UUID torch reports names
    the run's GPU, with nvidia-smi's "GPU-" prefix once whether torch's string has it or not."""
    import types

    import torch

    from horizon_ray.bench.runtime import GpuTelemetry

    for uuid in ("58a8f4a5-0d3c-4b1e-9f00-1234567890ab", "GPU-58a8f4a5-0d3c-4b1e-9f00-1234567890ab"):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, u=uuid: types.SimpleNamespace(uuid=u))
        assert GpuTelemetry(torch.device("cuda", 1))._gpu_id() == "GPU-58a8f4a5-0d3c-4b1e-9f00-1234567890ab"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace())
    assert GpuTelemetry(torch.device("cuda", 1))._gpu_id() == "1"


def test_gemm_shapes_rank_a_profiles_gemms_by_shape_with_their_rate():
    """A profiled step's GEMMs by input shapes: the rate from the shapes' FLOPs (addmm's product is its second
    and third inputs), slowest first, none where the calls launched no kernel; ops other than GEMMs are left
    out. The names it reads are a real profile's (the second half, on the CPU)."""
    from types import SimpleNamespace

    from horizon_ray.bench.runtime import gemm_shapes

    def ev(key, shapes, count, us):
        return SimpleNamespace(key=key, input_shapes=shapes, count=count, self_device_time_total=us)

    prof = SimpleNamespace(key_averages=lambda group_by_input_shape: [
        ev("aten::mm", [[16384, 2560], [2560, 9728]], 20, 20_343.0),
        ev("aten::addmm", [[9728, 2560], [9728, 16384], [16384, 2560], []], 8, 8_792.0),
        ev("aten::add_", [[16384, 2560], [16384, 2560]], 99, 50_000.0),
        ev("aten::addmm_", [[64, 32], [64, 16], [16, 32], []], 3, 0.0),  # launched nothing: no rate
    ])
    rows = gemm_shapes(prof)
    assert [r[0] for r in rows] == ["aten::mm", "aten::addmm", "aten::addmm_"]
    assert rows[2][3:] == [0.0, None]
    mm, addmm = rows[:2]
    assert mm[1:4] == [[[16384, 2560], [2560, 9728]], 20, 0.0203]
    assert mm[4] == round(2 * 16384 * 2560 * 9728 * 20 / 0.020343 / 1e12)  # 802 TFLOP/s
    assert addmm[4] == round(2 * 9728 * 16384 * 2560 * 8 / 0.008792 / 1e12)

    import torch
    from torch.profiler import ProfilerActivity, profile

    a, b, acc = torch.randn(64, 16), torch.randn(16, 32), torch.zeros(64, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as real:
        torch.mm(a, b)
        acc.addmm_(a, b)
    got = {r[0]: r[1:3] for r in gemm_shapes(real)}
    assert got == {"aten::mm": [[[64, 16], [16, 32]], 1], "aten::addmm_": [[[64, 32], [64, 16], [16, 32]], 1]}
