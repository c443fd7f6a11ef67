"""benchmarks/dpo.py, the DPO comparison the GPU box runs, on the CPU at the tiny shape: both systems run in
their child processes (the repository first on their path), on the same pairs, and their records carry what
the issue's targets read (tokens/s and the ratio to TRL, the reference pass apart, host RSS against the plan)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_dpo_bench_runs_both_systems_and_records_rss_against_the_plan(tmp_path):
    out = tmp_path / "dpo.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dpo.py"), "--shape", "tiny", "--device", "cpu",
                           "--steps", "1", "--method", "lora", "--tokens-per-step", "512", "--seq", "64",
                           "--micro", "4", "--gpu-budget-gib", "12", "--out", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, trl = json.loads(out.read_text())
    assert (ours["system"], trl["system"]) == ("horizon-ray", "trl")
    assert ours["status"] == trl["status"] == "ok"
    # the first timed step's loss: one step of lr 1e-6 from the reference, so ln 2 for every pair, on both sides
    # (each side its own random init)
    assert ours["losses"][0] == pytest.approx(math.log(2), abs=1e-3)
    assert trl["losses"][0] == pytest.approx(math.log(2), abs=1e-3)
    assert ours["ratio_trl"] == round(ours["tokens_per_s"] / trl["tokens_per_s"], 3)
    assert ours["reference_s"] > 0 and ours["total_s"] > ours["timed_s"]
    # each system checkpoints as it runs best: the engine keeps every layer's input and runs each layer again
    # once in the backward; transformers, checkpointing every 4th layer of the tiny shape's 8, runs 2 of them
    assert (ours["checkpoint_every"], ours["recomputed_layers"]) == (1, 1.0)
    assert (trl["checkpoint_every"], trl["recomputed_layers"]) == (4, 0.25)
    assert ours["gpu_budget_bytes"] == 12 * 2**30 and "gpu_budget_bytes" not in trl  # the peer has the whole GPU
    assert ours["planned_host_bytes"] > 0 and "plan_error" not in ours
    assert ours["rss_vs_plan"] == round(ours["host_rss_bytes"] / ours["planned_host_bytes"], 4)
    assert 0.1 < ours["rss_vs_plan"] < 1.5  # the plan counts a process's baseline; a tiny model is mostly that


def test_the_peer_record_says_the_checkpoint_interval_that_ran_not_the_one_asked_for(monkeypatch, capsys):
    """A transformers without ``every_n_layers`` checkpoints every decoder layer whatever the script asks; the
    record must then say 1 and 100% recomputed, the work the peer did (before: it said 4 beside 100%, and the
    notes read a quarter recomputed into a run that recomputed every layer)."""
    import importlib.util
    import inspect

    from transformers import PreTrainedModel

    spec = importlib.util.spec_from_file_location("dpo_bench", ROOT / "benchmarks" / "dpo.py")
    dpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dpo)
    original = PreTrainedModel.activation_checkpointing_enable
    assert "every_n_layers" in inspect.signature(original).parameters

    def older(self, activation_checkpointing_kwargs=None):  # the signature of a transformers without it
        return original(self, activation_checkpointing_kwargs=activation_checkpointing_kwargs, every_n_layers=1)

    monkeypatch.setattr(PreTrainedModel, "activation_checkpointing_enable", older)
    dpo.main(["--system", "trl", "--shape", "tiny", "--device", "cpu", "--steps", "1", "--method", "lora",
              "--tokens-per-step", "512", "--seq", "64", "--micro", "4"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["status"] == "ok", rec
    assert (rec["checkpoint_every"], rec["recomputed_layers"]) == (1, 1.0)
