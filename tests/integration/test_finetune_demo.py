"""`horizon-ray demo`: deterministic generated assets, and a shortened end-to-end run whose held-out eval
loss drops. (The full demo, 400 steps, is timed by hand: see the README.)"""

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from horizon_ray.job.demo import demo_spec, prepare_demo_assets
from horizon_ray.job.events import Eval, read_events

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_demo_assets_are_deterministic_and_reused(tmp_path):
    a, built_a = prepare_demo_assets(tmp_path / "a")
    b, built_b = prepare_demo_assets(tmp_path / "b")
    assert built_a and built_b
    assert _digest(a.root) == _digest(b.root)
    again, built = prepare_demo_assets(tmp_path / "a")
    assert not built and again == a
    # held out for real: no eval prompt is a training prompt
    train = {line.split('"content": "')[1].split('"')[0] for line in a.train_path.read_text().splitlines()}
    evals = {line.split('"content": "')[1].split('"')[0] for line in a.eval_path.read_text().splitlines()}
    assert evals and not evals & train
    spec = demo_spec(a, tmp_path / "run", ["training.max_steps=10", "training.schedule.warmup_steps=0"])
    spec.check_paths()
    assert spec.training.max_steps == 10


def test_an_interrupted_asset_build_is_rebuilt(tmp_path):
    assets, _ = prepare_demo_assets(tmp_path)
    (assets.root / "manifest.json").unlink()  # as if the build died before its last write
    again, built = prepare_demo_assets(tmp_path)
    assert built and (again.root / "manifest.json").is_file()


def test_short_demo_end_to_end(tmp_path):
    env = {**os.environ, "HORIZON_RAY_HOME": str(tmp_path / "home")}
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "horizon_ray", "demo", "--local", "--output-dir", str(out), "--samples", "3",
         "training.max_steps=60", "training.schedule.warmup_steps=10", "eval.every_steps=30",
         "checkpoint.every_steps=30", "engine.device=cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    assert "held-out eval loss" in proc.stdout and "held-out accuracy" in proc.stdout
    assert str(out / "final") in proc.stdout
    evals = [r.eval_loss for r in read_events(out / "metrics.jsonl") if isinstance(r, Eval)]
    assert len(evals) == 3
    assert evals[-1] < 0.6 * evals[0], evals
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "tokenizer.json").is_file()
    assert (out / "loss_curve.png").is_file()


@pytest.mark.integration
def test_demo_goes_through_the_local_service(tmp_path):
    """The default demo: a local Ray cluster, the coordinator, an agent, the REST API; the job is submitted
    over REST, its events followed, and it writes its outputs in the demo tenant's namespace."""
    env = {**os.environ, "HORIZON_RAY_HOME": str(tmp_path / "home"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    root = tmp_path / "service"
    proc = subprocess.run(
        [sys.executable, "-m", "horizon_ray", "demo", "--output-dir", str(root), "--samples", "2",
         "training.max_steps=20", "training.schedule.warmup_steps=5", "eval.every_steps=10",
         "checkpoint.every_steps=10", "engine.device=cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # on a port the OS picked (no --port), which the demo prints
    assert re.search(r"service up while the demo runs \(--keep-serving: until Ctrl-C\): dashboard "
                     r"http://127\.0\.0\.1:[1-9]\d*/", proc.stdout), proc.stdout[-3000:]
    assert "the demo's service has stopped" in proc.stdout  # it says so, after showing the dashboard's URL
    assert "submitted job job-" in proc.stdout and "over REST" in proc.stdout
    finals = list((root / "jobs" / "demo").glob("job-*/final/model.safetensors"))
    assert len(finals) == 1
    tensorboard = finals[0].parent.parent / "tensorboard"
    assert f"TensorBoard              {tensorboard}" in proc.stdout and tensorboard.is_dir()
    evals = [r.eval_loss for r in read_events(finals[0].parent.parent / "metrics.jsonl") if isinstance(r, Eval)]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert "checkpoint step=10" in proc.stdout  # events arrived through the SSE stream
    assert "step 20/20: loss " in proc.stdout and " tokens/s" in proc.stdout  # progress a person can read
