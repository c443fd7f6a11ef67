"""`horizon-ray finetune` with resources.gpus: 2 on the CPU: two gloo ranks over one host store, against one
rank with twice the micro-batches a step; and a resumed two-rank run against an uninterrupted one."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from horizon_ray.job.events import Done, Metrics, Start, read_events
from tests.tiny import job_assets, preference_assets

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return job_assets(tmp_path_factory.mktemp("assets"), 200)


def _spec(assets: Path, out: Path, gpus: int, grad_accum: int, max_steps: int = STEPS) -> Path:
    spec = {
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "train.jsonl"), "format": "auto", "eval_fraction": 0.1},
        "training": {"seq_len": 64, "micro_batch_size": 2, "grad_accum": grad_accum, "max_steps": max_steps,
                     "lr": 3e-3, "schedule": {"type": "constant"}, "weight_decay": 0.01, "seed": 5},
        "eval": {"every_steps": 3},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "engine": {"device": "cpu"},
        "resources": {"gpus": gpus},
        "output_dir": str(out),
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _weights(out: Path) -> dict:
    return load_file(out / "final" / "model.safetensors")


def test_two_ranks_train_as_one_with_twice_the_micro_batches(assets, tmp_path, finetune):
    one = finetune(_spec(assets, tmp_path / "one", gpus=1, grad_accum=4))
    assert one.returncode == 0, one.stderr[-3000:]
    two = finetune(_spec(assets, tmp_path / "two", gpus=2, grad_accum=2))
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for name, t in a.items():
        assert (b[name] - t).abs().max() <= 1e-5 * max(1.0, float(t.abs().max())), name
    ev = read_events(tmp_path / "two" / "metrics.jsonl")
    # the leader alone writes the job's events: one start, one metrics line a step, one done
    assert sum(isinstance(e, Start) for e in ev) == 1 and sum(isinstance(e, Done) for e in ev) == 1
    assert [e.step for e in ev if isinstance(e, Metrics)] == list(range(1, STEPS + 1))
    losses = {e.step: e.loss for e in read_events(tmp_path / "one" / "metrics.jsonl") if isinstance(e, Metrics)}
    for e in ev:
        if isinstance(e, Metrics):  # the loss over both ranks' tokens, as one rank with all of them reports it
            assert e.loss == pytest.approx(losses[e.step], rel=1e-5)


def test_a_two_rank_run_killed_after_a_checkpoint_resumes_exactly(assets, tmp_path, finetune):
    """SIGKILL of the leader's process group once the step-2 checkpoint is complete; --resume loads it on both
    ranks (the first writes the shared store, each takes the step count) and ends as the uninterrupted run."""
    straight = finetune(_spec(assets, tmp_path / "straight", gpus=2, grad_accum=2))
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    spec = _spec(assets, out, gpus=2, grad_accum=2)
    proc = subprocess.Popen([sys.executable, "-m", "horizon_ray", "finetune", "--config", str(spec)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list((out / "checkpoints").glob("*/COMPLETE")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job never wrote a checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the leader and its ranks: no cleanup of any kind
    proc.communicate(timeout=60)
    resumed = finetune(spec, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _weights(tmp_path / "straight"), _weights(out)
    for name, t in a.items():
        assert (b[name] - t).abs().max() <= 1e-6 * max(1.0, float(t.abs().max())), name


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return preference_assets(tmp_path_factory.mktemp("dpo-assets"), 64, 8)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_ranks_run_dpo_as_one_with_twice_the_micro_batches(pairs, tmp_path, finetune, method):
    """objective dpo over two gloo ranks: the leader computes the reference once, the follower reads it, each
    rank takes the reference log-probs of its own rows; losses, TRL's reward metrics and the weights equal one
    rank's with all the micro-batches."""
    def spec(out: Path, gpus: int, grad_accum: int) -> Path:
        doc = {
            "model": {"path": str(pairs / "model")},
            "data": {"path": str(pairs / "train.jsonl"),
                     "eval_path": str(pairs / "eval.jsonl")},
            "objective": "dpo", "dpo": {"beta": 0.1}, "method": method,
            "training": {"seq_len": 32, "micro_batch_size": 4, "grad_accum": grad_accum, "max_steps": 4,
                         "lr": 3e-3, "schedule": {"type": "constant"}, "seed": 3},
            "eval": {"every_steps": 2},
            "engine": {"device": "cpu"}, "resources": {"gpus": gpus}, "output_dir": str(out),
        }
        if method == "lora":
            doc["lora"] = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
        path = out.parent / f"{out.name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    one = finetune(spec(tmp_path / "one", gpus=1, grad_accum=2))
    assert one.returncode == 0, one.stderr[-3000:]
    two = finetune(spec(tmp_path / "two", gpus=2, grad_accum=1))
    assert two.returncode == 0, two.stderr[-3000:]
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    a, b = load_file(tmp_path / "one" / "final" / weights), load_file(tmp_path / "two" / "final" / weights)
    assert set(a) == set(b)
    for name, t in a.items():
        assert (b[name] - t).abs().max() <= 1e-5 * max(1.0, float(t.abs().max())), name
    runs = [[e for e in read_events(tmp_path / run / "metrics.jsonl") if isinstance(e, Metrics)]
            for run in ("one", "two")]
    assert [e.step for e in runs[1]] == [1, 2, 3, 4]
    for x, y in zip(*runs):
        assert y.loss == pytest.approx(x.loss, rel=1e-5)
        assert y.preference.keys() == x.preference.keys()
        for key, value in x.preference.items():
            assert y.preference[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert not (tmp_path / "two" / "reference" / "part-00000.safetensors").exists()
    assert (tmp_path / "two" / "reference" / "logps.safetensors").is_file()
