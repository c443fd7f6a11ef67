"""`horizon-ray finetune` end to end on a tiny model on the CPU, and exact resume after SIGKILL.

Every run is a real subprocess of the console script, as the node agent starts it. The interrupted runs
are killed with SIGKILL (no cleanup of any kind), once between two checkpoints and once in the middle of
writing a checkpoint; `--resume` must then end with bit-identical weights to the uninterrupted run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from horizon_ray.job import checkpoints as ck
from horizon_ray.job.events import read_events
from horizon_ray.job.metrics import curves
from horizon_ray.jobspec import JobSpec
from tests.tiny import job_assets

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 12
CKPT_EVERY = 4



@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return job_assets(tmp_path_factory.mktemp("assets"), 400)


def _write_spec(assets: Path, out: Path) -> Path:
    spec = {
        "name": "tiny",
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "train.jsonl"), "format": "auto", "eval_fraction": 0.1},
        "training": {
            "seq_len": 64, "micro_batch_size": 4, "grad_accum": 2, "max_steps": TOTAL_STEPS, "lr": 3e-3,
            "schedule": {"type": "cosine", "warmup_steps": 2}, "weight_decay": 0.01, "seed": 3,
        },
        "eval": {"every_steps": 4},
        "checkpoint": {"every_steps": CKPT_EVERY, "keep": 2},
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


def _weights(final_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(final_dir / "model.safetensors")


def test_finetune_writes_the_contract_outputs(baseline):
    records = read_events(baseline / "metrics.jsonl")
    types = [r.TYPE for r in records]
    assert types[0] == "start" and types[-1] == "done"
    assert set(types) == {"start", "metrics", "eval", "checkpoint-begin", "checkpoint", "done"}
    metrics = [r for r in records if r.TYPE == "metrics"]
    assert [r.step for r in metrics] == list(range(1, TOTAL_STEPS + 1))
    for r in metrics:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "host_rss_bytes", "total_steps", "eta_s", "time"):
            assert getattr(r, key) is not None, key
        assert r.total_steps == TOTAL_STEPS and r.tokens_per_s > 0 and r.host_rss_bytes > 2**20
    evals = [r for r in records if r.TYPE == "eval"]
    assert [r.step for r in evals] == [0, 4, 8, TOTAL_STEPS]
    assert evals[-1].eval_loss < evals[0].eval_loss
    # each checkpoint announced before it is written, then reported complete
    assert [(r.TYPE, r.step) for r in records if r.TYPE.startswith("checkpoint")] == [
        ("checkpoint-begin", 4), ("checkpoint", 4), ("checkpoint-begin", 8), ("checkpoint", 8)]
    assert records[-1].final_dir == str(baseline / "final")

    # keep=2 and no checkpoint after the last step: steps 4 and 8, both complete, nothing else.
    assert [c.step for c in ck.complete_checkpoints(baseline / "checkpoints")] == [4, 8]
    assert sorted(p.name for p in (baseline / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]
    assert (baseline / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert JobSpec.from_yaml(baseline / "job.yaml").training.max_steps == TOTAL_STEPS


def test_tensorboard_event_files_lie_beside_metrics(baseline):
    """TensorBoard reads the job's scalars from <output_dir>/tensorboard: the same steps and losses as
    metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(baseline / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= tags
    metrics = [r for r in read_events(baseline / "metrics.jsonl") if r.TYPE == "metrics"]
    logged = acc.Scalars("train/loss")
    assert [x.step for x in logged] == [r.step for r in metrics]
    assert [x.value for x in logged] == pytest.approx([r.loss for r in metrics], rel=1e-6)
    assert [x.step for x in acc.Scalars("eval/loss")] == [0, 4, 8, TOTAL_STEPS]


_FAKE_WANDB = textwrap.dedent(
    """
    # a stand-in for the wandb package with its API's shape: every call is recorded in $FAKE_TRACKER_LOG
    import json, os

    def _record(*call):
        with open(os.environ["FAKE_TRACKER_LOG"], "a") as f:
            print(json.dumps(call), file=f)

    class Run:
        def log(self, values, step=None):
            _record("wandb.log", step, values)

        def finish(self, exit_code=0):
            _record("wandb.finish", exit_code)

    def init(project=None, entity=None, name=None, tags=None, config=None, dir=None, id=None, resume=None):
        _record("wandb.init", project, name, tags, id, resume, config["training.max_steps"])
        return Run()
    """
)
_FAKE_MLFLOW = textwrap.dedent(
    """
    # a stand-in for the mlflow package with its API's shape: every call is recorded in $FAKE_TRACKER_LOG
    import json, os, types

    def _record(*call):
        with open(os.environ["FAKE_TRACKER_LOG"], "a") as f:
            print(json.dumps(call), file=f)

    def set_tracking_uri(uri):
        _record("mlflow.set_tracking_uri", uri)

    def set_experiment(name):
        _record("mlflow.set_experiment", name)

    def start_run(run_id=None, run_name=None):
        _record("mlflow.start_run", run_id, run_name)
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "run-1"))

    def log_params(params):
        _record("mlflow.log_params", params["training.seed"])

    def log_metrics(metrics, step=None):
        _record("mlflow.log_metrics", step, metrics)

    def end_run(status="FINISHED"):
        _record("mlflow.end_run", status)
    """
)


def test_the_specs_integrations_log_to_wandb_and_mlflow_when_installed(assets, tmp_path):
    """The trackers named in `integrations` get the run's configuration, every step's scalars and the end;
    one whose package is missing leaves the job to train and says so in its log."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "wandb.py").write_text(_FAKE_WANDB)
    (site / "mlflow.py").write_text(_FAKE_MLFLOW)
    calls = tmp_path / "calls.jsonl"
    out = tmp_path / "run"
    spec = yaml.safe_load(_write_spec(assets, out).read_text())
    spec["training"]["max_steps"] = 3
    spec["checkpoint"] = {"every_steps": 0}
    spec["integrations"] = {"tensorboard": False, "wandb": {"project": "p", "tags": ["t"]},
                            "mlflow": {"experiment": "e", "tracking_uri": "http://127.0.0.1:9/"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "FAKE_TRACKER_LOG": str(calls),
           "HORIZON_RAY_JOB_ID": "job-0123456789ab"}
    proc = subprocess.run([sys.executable, "-m", "horizon_ray", "finetune", "--config", str(tmp_path / "job.yaml"),
                           "--no-progress"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    log = [json.loads(line) for line in calls.read_text().splitlines()]
    assert log[0] == ["wandb.init", "p", "tiny", ["t"], "job-0123456789ab", "allow", 3]
    assert [c for c in log if c[0].startswith("mlflow.") and c[0] != "mlflow.log_metrics"] == [
        ["mlflow.set_tracking_uri", "http://127.0.0.1:9/"], ["mlflow.set_experiment", "e"],
        ["mlflow.start_run", None, "tiny"], ["mlflow.log_params", "3"], ["mlflow.end_run", "FINISHED"]]
    losses = {r.step: r.loss for r in read_events(out / "metrics.jsonl") if r.TYPE == "metrics"}
    assert {c[1]: c[2]["train/loss"] for c in log if c[0] == "wandb.log" and "train/loss" in c[2]} == \
        pytest.approx(losses)
    assert {c[1]: c[2]["train_loss"] for c in log if c[0] == "mlflow.log_metrics" and "train_loss" in c[2]} == \
        pytest.approx(losses)
    assert log[-1] in (["wandb.finish", 0], ["mlflow.end_run", "FINISHED"]) and ["wandb.finish", 0] in log
    assert (out / "mlflow_run_id").read_text().strip() == "run-1"  # a resume continues this run
    assert not (out / "tensorboard").exists()

    (site / "mlflow.py").unlink()  # not installed on this node: the job trains and says why it did not log
    spec["output_dir"] = str(tmp_path / "run2")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "horizon_ray", "finetune", "--config", str(tmp_path / "job.yaml"),
                           "--no-progress"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "warning: integrations.mlflow: its package is not installed on this node" in proc.stderr


def test_final_is_a_usable_hf_model_dir(baseline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from horizon_ray.engine import Engine, EngineConfig

    final = baseline / "final"
    tok = AutoTokenizer.from_pretrained(final, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True, dtype=torch.float32).eval()
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "copy abc"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)
                        ["input_ids"]])
    with torch.no_grad():
        hf_logits = model(input_ids=ids).logits
    eng = Engine.from_pretrained(final, EngineConfig(device="cpu"))
    try:
        ours = eng.forward_logits(ids)
    finally:
        eng.close()
    torch.testing.assert_close(ours, hf_logits, rtol=1e-4, atol=1e-4)
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]


# Runs the console script with a hook that stops the job at a chosen point, for the parent to SIGKILL
# (between checkpoints), or SIGKILLs it from inside save_state with a truncated state file on disk.
_HOOKED = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from horizon_ray.engine import Engine

    mode, at, flag = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if mode == "between":
        real_step, calls = Engine.train_step, [0]
        def train_step(self, micro_batches):
            if calls[0] == at:  # steps 1..at are done and logged: park here until killed
                flag.write_text("parked")
                time.sleep(600)
            calls[0] += 1
            return real_step(self, micro_batches)
        Engine.train_step = train_step
    else:
        real_save = Engine.save_state
        def save_state(self, d):
            real_save(self, d)
            if self.step == at:  # cut the state file short and die before the checkpoint completes
                with open(os.path.join(d, "engine_state.safetensors"), "r+b") as f:
                    f.truncate(100)
                os.kill(os.getpid(), signal.SIGKILL)
        Engine.save_state = save_state
    from horizon_ray.cli import main
    sys.exit(main(sys.argv[4:]))
    """
)


def _stopped_run(config: Path, mode: str, at: int, flag: Path, sig: signal.Signals) -> str:
    args = [sys.executable, "-c", _HOOKED, mode, str(at), str(flag), "finetune", "--config", str(config)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode == "between":
        deadline = time.monotonic() + 300
        while not flag.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the job never reached the kill point"
            time.sleep(0.05)
        os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=300)
    # SIGKILL: the process just vanishes; SIGTERM: it stops itself with exit code 128 + 15.
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 143), err
    return err


def test_a_job_stopped_before_its_first_checkpoint_says_a_rerun_starts_over(assets, tmp_path):
    """A cancel (the agent's SIGTERM) before any checkpoint has nothing to resume: the job's last event says a
    rerun starts from the beginning, not that --resume continues it."""
    out = tmp_path / "run"
    err = _stopped_run(_write_spec(assets, out), "between", 2, tmp_path / "parked", signal.SIGTERM)
    said = "stopped by SIGTERM at step 2; no checkpoint was written, so a rerun (--resume) starts from the beginning"
    assert err.strip().splitlines()[-1] == f"error: {said}"
    assert read_events(out / "metrics.jsonl")[-1].message == said
    assert ck.latest_checkpoint(out / "checkpoints") is None


@pytest.mark.parametrize(
    "mode, at, sig, resumes_from",
    [("between", 6, signal.SIGKILL, 4), ("checkpoint", 8, signal.SIGKILL, 4), ("between", 9, signal.SIGTERM, 8)],
    ids=["sigkill-between-checkpoints", "sigkill-mid-checkpoint-write", "sigterm-between-checkpoints"],
)
def test_resume_after_a_kill_matches_the_uninterrupted_run(assets, baseline, tmp_path, mode, at, sig,
                                                            resumes_from, finetune):
    out = tmp_path / "run"
    config = _write_spec(assets, out)
    err = _stopped_run(config, mode, at, tmp_path / "parked", sig)
    if sig == signal.SIGTERM:
        said = f"stopped by SIGTERM at step {at}; rerun with --resume to continue from the checkpoint of step " \
               f"{resumes_from}"
        assert err.strip().splitlines()[-1] == f"error: {said}"
        last = read_events(out / "metrics.jsonl")[-1]
        assert last.TYPE == "error" and last.message == said and last.step == at

    # The kill left the run without final/ and with `resumes_from` as the newest complete checkpoint.
    assert not (out / "final").exists()
    assert ck.latest_checkpoint(out / "checkpoints").step == resumes_from
    if mode == "checkpoint":
        assert any(".tmp-" in p.name for p in (out / "checkpoints").iterdir()), "no torn checkpoint was left"

    proc = finetune(config, "--resume")
    assert proc.returncode == 0, proc.stderr
    starts = [r for r in read_events(out / "metrics.jsonl") if r.TYPE == "start"]
    assert [s.resumed_from for s in starts] == [None, resumes_from]
    assert not [p for p in (out / "checkpoints").iterdir() if ".tmp-" in p.name]

    # Same data, same schedule: every step's loss and lr match the uninterrupted run...
    base_train, base_eval = curves(read_events(baseline / "metrics.jsonl"))
    train, evals = curves(read_events(out / "metrics.jsonl"))
    assert [(s, r.loss, r.lr) for s, r in train.items()] == [(s, r.loss, r.lr) for s, r in base_train.items()]
    # ...and so do the final weights, bit for bit.
    expected, got = _weights(baseline / "final"), _weights(out / "final")
    assert expected.keys() == got.keys()
    differ = {k: (expected[k] - got[k]).abs().max().item() for k in expected if not torch.equal(expected[k], got[k])}
    assert not differ, f"weights differ after resume (max abs diff): {differ}"
    assert evals[TOTAL_STEPS] == base_eval[TOTAL_STEPS]


def test_rerunning_a_finished_job(baseline, tmp_path, finetune):
    out = tmp_path / "copy"
    shutil.copytree(baseline, out)
    config = out.parent / "copy.yaml"
    config.write_text((baseline.parent / "baseline.yaml").read_text().replace(str(baseline), str(out)))
    before = _weights(out / "final")
    proc = finetune(config, "--resume")  # a requeued job that had finished: nothing to redo
    assert proc.returncode == 0, proc.stderr
    assert "already finished" in proc.stdout
    records = read_events(out / "metrics.jsonl")
    assert [r.TYPE for r in records[-2:]] == ["done", "done"]
    assert all(torch.equal(before[k], v) for k, v in _weights(out / "final").items())
    proc = finetune(config)  # a fresh run must not overwrite it
    assert proc.returncode == 2
    assert "already holds a finished run" in proc.stderr


def test_resume_without_checkpoint_starts_fresh(assets, baseline, tmp_path, finetune):
    out = tmp_path / "fresh"
    proc = finetune(_write_spec(assets, out), "--resume", "checkpoint.every_steps=0")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    expected, got = _weights(baseline / "final"), _weights(out / "final")
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    done = [r for r in read_events(out / "metrics.jsonl") if r.TYPE == "done"]
    assert json.loads(json.dumps(done[0].to_dict()))["final_dir"] == str(out / "final")
