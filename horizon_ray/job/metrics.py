"""metrics.jsonl (the runner's events, ``events``; the stream the cluster reads) and the loss-curve PNG."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TextIO

from horizon_ray.atomic import Commit, atomic_path
from horizon_ray.job.events import Eval, Event, Metrics, decode, encode, read_events

METRICS_FILE = "metrics.jsonl"  # a job's events in its output directory: what the runner writes and the agent tails
SPEC_FILE = "job.yaml"  # the spec a job runs with, in its output directory: written by the agent and the runner


class MetricsWriter:
    """Appends one event (``events.encode``) per line; each line is flushed at once so that a tailing reader
    sees it.

    A resumed job appends to the same file after a ``Start`` that carries ``resumed_from``; lines after it
    supersede earlier lines of the same step (the steps the interrupted run did after its last checkpoint).
    A resume by hand first drops those lines (``drop_after``), so that the file a person reads has each step
    once; under a node agent the file stays append-only, as the agent tails it by byte offset.
    """

    def __init__(self, path: str | os.PathLike,
                 guard: Callable[[str], AbstractContextManager] | None = None) -> None:
        """`guard(what)` is held around each write (a job's lease: a fenced engine adds no line)."""
        self.path = Path(path)
        self._guard = guard or (lambda what: nullcontext())
        self.sinks: list = []  # each written event goes to their log() too (the job's trackers), under the guard
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._guard("opening metrics.jsonl"):
            self._file: TextIO | None = open(self.path, "a", encoding="utf-8")
            if self._file.tell() > 0:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
                if torn:  # a killed writer's last line: end it, so that the next line is read whole
                    self._file.write("\n")
                    self._file.flush()

    def write(self, event: Event) -> Event:
        if self._file is not None:
            with self._guard(f"writing a {event.TYPE} event"):
                self._file.write(encode(event))
                self._file.flush()
                for sink in self.sinks:
                    sink.log(event)
        return event

    def drop_after(self, step: int) -> int:
        """Rewrite the file without the events of steps after `step` (an interrupted run's work past its last
        checkpoint, which a resume from `step` redoes) and without torn lines; returns how many went."""
        if self._file is None:
            return 0
        lines = self.path.read_bytes().splitlines(keepends=True)
        kept = []
        for raw in lines:
            try:
                event = decode(json.loads(raw))
            except ValueError:
                continue
            if event is None or event.step <= step:  # another writer's line stays
                kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
        if len(kept) == len(lines):
            return 0
        with self._guard("dropping the lines a resume redoes from metrics.jsonl"):
            self._file.close()
            with atomic_path(self.path) as tmp:
                tmp.write_bytes(b"".join(kept))
            self._file = open(self.path, "a", encoding="utf-8")
        return len(lines) - len(kept)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def curves(events: list[Event]) -> tuple[dict[int, Metrics], dict[int, float]]:
    """Latest ``Metrics`` per step and latest eval loss per step (later lines win after a resume)."""
    train: dict[int, Metrics] = {}
    evals: dict[int, float] = {}
    for e in events:
        if isinstance(e, Metrics):
            train[e.step] = e
        elif isinstance(e, Eval) and e.eval_loss is not None:
            evals[e.step] = e.eval_loss
    return dict(sorted(train.items())), dict(sorted(evals.items()))


def plot_loss_curve(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "",
                    commit: Commit | None = None) -> Path:
    """Training loss (raw and smoothed) and eval loss against the step, written with matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = curves(read_events(metrics_path))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [s for s, m in train.items() if m.loss is not None]
    losses = [m.loss for m in train.values() if m.loss is not None]
    if steps:
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="train loss")
        ax.plot(steps, _ema(losses, 0.8), color="tab:blue", linewidth=1.5, label="train loss (EMA)")
    if evals:
        ax.plot(list(evals), list(evals.values()), "o-", color="tab:orange", label="eval loss")
    values = [v for v in [*losses, *evals.values()] if v > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")  # a fine-tune falls by orders of magnitude; linear would hide the tail
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(png_path)
    with atomic_path(out, commit) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out


def _ema(values: list[float], beta: float) -> list[float]:
    out, avg = [], None
    for v in values:
        avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg)
    return out
