"""metrics.jsonl: the runner's typed events (horizon_ray.job.events), one flushed line per event, readable
while written, and decoded the same way by every reader."""

import json

import pytest

from horizon_ray.job.events import (
    EVENTS,
    Checkpoint,
    CheckpointBegin,
    Done,
    Error,
    Eval,
    Metrics,
    Start,
    decode,
    encode,
    read_events,
)
from horizon_ray.job.metrics import MetricsWriter, curves, plot_loss_curve


def test_each_event_is_a_flushed_json_line_with_type_step_and_time(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        m.write(Start(step=0, total_steps=3))
        m.write(Metrics(step=1, loss=2.5, lr=1e-3, grad_norm=1.2, tokens_per_s=100.0, host_rss_bytes=1,
                        total_steps=3, eta_s=2.0))
        # readable by a tailing reader before the writer closes
        lines = path.read_text().splitlines()
        assert len(lines) == 2
        m.write(Eval(step=1, eval_loss=float("nan")))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in records] == ["start", "metrics", "eval"]
    assert all(isinstance(r["time"], float) and "step" in r for r in records)
    assert records[1]["loss"] == 2.5
    assert records[2]["eval_loss"] is None  # NaN is not JSON


def test_a_torn_last_line_is_skipped_and_later_lines_win(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        m.write(Metrics(step=1, loss=3.0))
        m.write(Metrics(step=2, loss=2.0))
    with open(path, "a") as f:
        f.write('{"type": "metrics", "step": 3, "lo')  # killed mid-line
    with MetricsWriter(path) as m:  # the resumed run appends
        m.write(Start(step=1, total_steps=3, resumed_from=1))
        m.write(Metrics(step=2, loss=1.5))
        m.write(Eval(step=2, eval_loss=1.7))
    train, evals = curves(read_events(path))
    assert {s: r.loss for s, r in train.items()} == {1: 3.0, 2: 1.5}
    assert evals == {2: 1.7}


def test_loss_curve_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        for s in range(1, 20):
            m.write(Metrics(step=s, loss=5.0 / s))
        m.write(Eval(step=10, eval_loss=1.0))
    png = plot_loss_curve(path, tmp_path / "loss.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp-*"))


def test_a_writer_after_a_torn_line_starts_on_a_line_of_its_own(tmp_path):
    from horizon_ray.cluster.agent import read_new_events

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "metrics", "step": 1, "loss": 1.0}\n{"type": "metrics", "st')  # a killed writer
    with MetricsWriter(path) as w:
        w.write(Start(step=1, total_steps=3, resumed_from=1))
    lines, _ = read_new_events(path, 0)
    assert [(type(e), e.step) for e in lines] == [(Metrics, 1), (Start, 1)]


@pytest.mark.parametrize("event", [
    Start(step=0, total_steps=9, resumed_from=None, name="n", device="cpu", compute_dtype="float32",
          method="lora", num_params=10, trainable_params=2, train_examples=5, eval_examples=1, steps_per_epoch=3,
          training_hash="abc"),
    Metrics(step=1, loss=0.5, lr=1e-4, grad_norm=0.3, tokens_per_s=10.0, host_rss_bytes=7, total_steps=9, eta_s=1.0),
    Eval(step=2, eval_loss=0.4, eval_tokens=100),
    CheckpointBegin(step=3),
    Checkpoint(step=3, path="/o/checkpoints/step-00000003", pruned=[1]),
    Done(step=9, final_dir="/o/final", eval_loss=0.3, wall_s=2.5),
    Error(step=4, message="stopped by SIGTERM"),
])
def test_every_event_round_trips_through_a_line(event):
    assert decode(json.loads(encode(event))) == event
    assert encode(event).endswith("\n") and encode(event).count("\n") == 1


def test_the_protocol_names_every_message_once():
    assert list(EVENTS) == ["start", "metrics", "eval", "checkpoint-begin", "checkpoint", "done", "error"]
    assert decode({"type": "metrics", "step": 1}) is None  # a required field is missing: not an event
    assert decode({"type": "gossip", "step": 1}) is None and decode([1, 2]) is None
    # a field a newer runner adds does not hide the event from an older reader
    assert decode({"type": "eval", "step": 1, "time": 1.0, "eval_loss": 1.0, "new_field": 3}) == \
        Eval(step=1, time=1.0, eval_loss=1.0)
