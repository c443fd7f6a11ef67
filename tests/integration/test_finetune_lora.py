"""`horizon-ray finetune` with `method: lora` end to end on a tiny model on the CPU: the adapter in final/
(PEFT format, with the tokenizer; every norm trained too), the merged model in final/merged/, and exact
resume after SIGKILL with dropout on (the masks are a function of the step, not of the process)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from horizon_ray.job import checkpoints as ck
from horizon_ray.job.events import read_events
from horizon_ray.job.metrics import curves
from tests.tiny import job_assets

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 8
LORA = {"r": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj", "gate_proj", "down_proj"],
        "modules_to_save": ["norm"], "merge": True}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return job_assets(tmp_path_factory.mktemp("assets"), 300)


def _write_spec(assets: Path, out: Path) -> Path:
    spec = {
        "name": "tiny-lora",
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "train.jsonl"), "format": "auto", "eval_fraction": 0.1},
        "method": "lora",
        "lora": LORA,
        "training": {"seq_len": 64, "micro_batch_size": 4, "grad_accum": 2, "max_steps": TOTAL_STEPS, "lr": 1e-2,
                     "schedule": {"type": "cosine", "warmup_steps": 1}, "weight_decay": 0.01, "seed": 3},
        "eval": {"every_steps": 4},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "engine": {"device": "cpu"},
        "output_dir": str(out),
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def baseline(assets, tmp_path_factory, finetune):
    out = tmp_path_factory.mktemp("runs") / "baseline"
    proc = finetune(_write_spec(assets, out))
    assert proc.returncode == 0, proc.stderr
    return out


def test_lora_job_writes_an_adapter_and_a_merged_model(assets, baseline):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from horizon_ray.engine import Engine, EngineConfig

    final = baseline / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert (final / "tokenizer.json").is_file() and (final / "merged" / "tokenizer.json").is_file()
    assert not (final / "model.safetensors").exists()  # the adapter, not a full model
    saved = load_file(final / "adapter_model.safetensors")
    prefix = "base_model.model.model."
    assert {prefix + "norm.weight", prefix + "layers.0.input_layernorm.weight"} <= set(saved)
    start = read_events(baseline / "metrics.jsonl")[0]
    assert start.method == "lora" and 0 < start.trainable_params < start.num_params
    evals = [r for r in read_events(baseline / "metrics.jsonl") if r.TYPE == "eval"]
    assert evals[-1].eval_loss < evals[0].eval_loss

    ids = torch.randint(3, 262, (2, 20), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(assets / "model", local_files_only=True, dtype=torch.float32)
    peft_logits = PeftModel.from_pretrained(base, final).eval()(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(final / "merged", local_files_only=True, dtype=torch.float32)
    torch.testing.assert_close(merged.eval()(input_ids=ids).logits, peft_logits, rtol=1e-4, atol=1e-4)
    eng = Engine.from_pretrained(final, EngineConfig(device="cpu"))  # the base it names + the adapter
    try:
        torch.testing.assert_close(eng.forward_logits(ids), peft_logits, rtol=1e-4, atol=1e-4)
    finally:
        eng.close()


_PARKED = """
import sys, time
from pathlib import Path
from horizon_ray.engine import Engine
at, flag = int(sys.argv[1]), Path(sys.argv[2])
real_step, calls = Engine.train_step, [0]
def train_step(self, micro_batches):
    if calls[0] == at:  # steps 1..at are done: park here until killed
        flag.write_text("parked")
        time.sleep(600)
    calls[0] += 1
    return real_step(self, micro_batches)
Engine.train_step = train_step
from horizon_ray.cli import main
sys.exit(main(sys.argv[3:]))
"""


def test_resume_after_sigkill_matches_the_uninterrupted_run(assets, baseline, tmp_path, finetune):
    out = tmp_path / "run"
    config = _write_spec(assets, out)
    flag = tmp_path / "parked"
    proc = subprocess.Popen([sys.executable, "-c", _PARKED, "5", str(flag), "finetune", "--config", str(config)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the job never reached the kill point"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert ck.latest_checkpoint(out / "checkpoints").step == 4

    done = finetune(config, "--resume")
    assert done.returncode == 0, done.stderr
    base_train, _ = curves(read_events(baseline / "metrics.jsonl"))
    train, _ = curves(read_events(out / "metrics.jsonl"))
    assert [(s, r.loss) for s, r in train.items()] == [(s, r.loss) for s, r in base_train.items()]
    expected = load_file(baseline / "final" / "adapter_model.safetensors")
    got = load_file(out / "final" / "adapter_model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
