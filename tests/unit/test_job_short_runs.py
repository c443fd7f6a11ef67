"""A short run of the demo's spec, and one refused for its data, as `horizon-ray finetune` users meet them: the
warmup is clamped below the run's steps (and it says so), every metrics line counts the tokens trained so far, and
a dataset error leaves no output directory behind."""

from __future__ import annotations

import json

import pytest

from horizon_ray.job.demo import demo_spec, prepare_demo_assets
from horizon_ray.job.events import Metrics, Start, read_events
from horizon_ray.job.runner import load_data, run_job
from horizon_ray.job.schedule import lr_at


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_demo_assets(tmp_path_factory.mktemp("home"))[0]


def test_max_steps_3_on_the_demo_spec_clamps_the_warmup_and_counts_tokens(assets, tmp_path, capsys):
    spec = demo_spec(assets, tmp_path / "out", ["training.max_steps=3", "eval.every_steps=0", "engine.device=cpu"])
    assert spec.training.schedule.warmup_steps == 20
    result = run_job(spec, progress=False)
    assert result.total_steps == 3
    assert "warning: training.schedule.warmup_steps 20 is not below the job's 3 steps; warming up for 2 instead" \
        in capsys.readouterr().out
    data = load_data(spec)
    assert data.schedule.warmup_steps == 2 and spec.training.schedule.warmup_steps == 20  # the spec stays as given
    events = read_events(tmp_path / "out" / "metrics.jsonl")
    metrics = [e for e in events if isinstance(e, Metrics)]
    assert [m.lr for m in metrics] == pytest.approx([lr_at(s, 3, 3e-3, data.schedule) for s in range(3)])
    assert metrics[0].lr == pytest.approx(3e-3 / 2)  # step 1 of a 2-step warmup: half the peak
    per_step = [data.sampler.tokens_for_step(s) for s in range(3)]
    assert [m.tokens_seen for m in metrics] == [sum(per_step[:i + 1]) for i in range(3)] and per_step[0] > 0
    assert sum(isinstance(e, Start) for e in events) == 1


def test_a_data_error_leaves_no_half_made_output_dir(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    out = tmp_path / "runs" / "new"
    spec = demo_spec(assets, out, [f"data.path={bad}", "data.eval_path=null", "training.max_steps=2",
                                   "engine.device=cpu"])
    with pytest.raises(ValueError, match="bad.jsonl:1: no assistant message"):
        run_job(spec, progress=False)
    assert not out.exists()
    out.mkdir(parents=True)  # a directory the user made stays, with why the job stopped
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        run_job(spec, progress=False)
    assert (out / "metrics.jsonl").is_file()


def test_a_resume_by_hand_leaves_each_step_once_in_metrics_jsonl(assets, tmp_path):
    from horizon_ray.job.runner import DONE

    out = tmp_path / "out"
    overrides = ["training.max_steps=3", "eval.every_steps=0", "checkpoint.every_steps=2", "engine.device=cpu"]
    run_job(demo_spec(assets, out, overrides), progress=False)
    # as if the run had died after step 3, before final/: its newest checkpoint is step 2's
    import shutil

    shutil.rmtree(out / "final")
    (out / DONE).unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"type": "metrics", "step": 3, "lo')  # and torn its last line
    before = [e.step for e in read_events(out / "metrics.jsonl") if isinstance(e, Metrics)]
    assert before == [1, 2, 3]
    result = run_job(demo_spec(assets, out, overrides), resume=True, progress=False)
    assert result.start_step == 2 and result.total_steps == 3
    events = read_events(out / "metrics.jsonl")
    assert [e.step for e in events if isinstance(e, Metrics)] == [1, 2, 3]
    assert [(e.step, e.resumed_from) for e in events if isinstance(e, Start)] == [(0, None), (2, 2)]
    tokens = [e.tokens_seen for e in events if isinstance(e, Metrics)]
    assert tokens[2] > tokens[1] > tokens[0] > 0  # the resumed run counts the steps before it too
    assert all(line.endswith("}") for line in (out / "metrics.jsonl").read_text().splitlines())


def test_tokens_per_s_counts_the_host_update_a_checkpoint_waits_for(assets, tmp_path, monkeypatch):
    """A checkpoint waits for the step's host update before it saves; the next step then waits for none. With
    that wait outside the step timer, a run whose host update is long against its step reported the rate of its
    steps alone (here 1,281 tok/s, with 7.5 s of waiting left out of 4 steps). The wait counts to the step before
    it now, so tokens/s is at most the tokens over the updates the window waited for."""
    import time

    from horizon_ray.engine.optimizer import HostAdamW

    update, calls = HostAdamW.update, []

    def slow(self, unit, *a, **kw):  # a host update far longer than the demo model's step
        calls.append(unit)
        time.sleep(0.5)
        return update(self, unit, *a, **kw)

    monkeypatch.setattr(HostAdamW, "update", slow)
    spec = demo_spec(assets, tmp_path / "out", ["training.max_steps=4", "eval.every_steps=0", "engine.device=cpu",
                                                "checkpoint.every_steps=1", "checkpoint.keep=1"])
    run_job(spec, progress=False)
    last = [e for e in read_events(tmp_path / "out" / "metrics.jsonl") if isinstance(e, Metrics)][-1]
    units = len(calls) // 4  # each step updates every unit once
    drained = 3 * units * 0.5  # the updates of steps 1-3, each waited for by the checkpoint after its step
    assert last.step == 4 and units >= 2
    # (a little of each update runs before its checkpoint starts waiting: 0.8 of it at least is waited for)
    assert last.tokens_per_s <= last.tokens_seen / (0.8 * drained), (last.tokens_per_s, last.tokens_seen, drained)
