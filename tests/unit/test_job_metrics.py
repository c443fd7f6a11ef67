"""metrics.jsonl: the contract's event types, one flushed line per event, readable while written."""

import json

from horizon_ray.job.metrics import MetricsWriter, curves, plot_loss_curve, read_metrics


def test_each_event_is_a_flushed_json_line_with_type_step_and_time(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        m.write("start", 0, total_steps=3)
        m.write("metrics", 1, loss=2.5, lr=1e-3, grad_norm=1.2, tokens_per_s=100.0, host_rss_bytes=1,
                total_steps=3, eta_s=2.0)
        # readable by a tailing reader before the writer closes
        lines = path.read_text().splitlines()
        assert len(lines) == 2
        m.write("eval", 1, eval_loss=float("nan"))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in records] == ["start", "metrics", "eval"]
    assert all(isinstance(r["time"], float) and "step" in r for r in records)
    assert records[1]["loss"] == 2.5
    assert records[2]["eval_loss"] is None  # NaN is not JSON


def test_a_torn_last_line_is_skipped_and_later_lines_win(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        m.write("metrics", 1, loss=3.0)
        m.write("metrics", 2, loss=2.0)
    with open(path, "a") as f:
        f.write('{"type": "metrics", "step": 3, "lo')  # killed mid-line
    with MetricsWriter(path) as m:  # the resumed run appends
        m.write("start", 1, resumed_from=1)
        m.write("metrics", 2, loss=1.5)
        m.write("eval", 2, eval_loss=1.7)
    train, evals = curves(read_metrics(path))
    assert {s: r["loss"] for s, r in train.items()} == {1: 3.0, 2: 1.5}
    assert evals == {2: 1.7}


def test_loss_curve_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        for s in range(1, 20):
            m.write("metrics", s, loss=5.0 / s)
        m.write("eval", 10, eval_loss=1.0)
    png = plot_loss_curve(path, tmp_path / "loss.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp-*"))


def test_a_writer_after_a_torn_line_starts_on_a_line_of_its_own(tmp_path):
    from horizon_ray.cluster.agent import read_metrics_lines
    from horizon_ray.job.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "metrics", "step": 1}\n{"type": "metrics", "st')  # the killed writer's last line
    with MetricsWriter(path) as w:
        w.write("start", 1, resumed_from=1)
    lines, _ = read_metrics_lines(path, 0)
    assert [(ln["type"], ln["step"]) for ln in lines] == [("metrics", 1), ("start", 1)]
