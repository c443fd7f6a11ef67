"""Terminal progress of a job: a rich progress bar on a terminal, a plain line every ~5% otherwise
(logs of the node agent, CI, pipes)."""

from __future__ import annotations

import sys
import time
from typing import Any


def format_eta(seconds: float | None) -> str:
    """Seconds as h:mm:ss or m:ss ("?" when unknown): how every progress line shows an ETA."""
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_rewards(preference: Any) -> str | None:
    """ "reward accuracy 87.5 %, margin 0.412" from a preference job's metrics (TRL's names), else None."""
    if not isinstance(preference, dict) or not isinstance(preference.get("rewards/accuracies"), int | float):
        return None
    margin = preference.get("rewards/margins")
    return (f"reward accuracy {100 * preference['rewards/accuracies']:.1f} %"
            + (f", margin {margin:.3f}" if isinstance(margin, int | float) else ""))


class Progress:
    """``update(step, loss=..., tokens_per_s=..., eta_s=..., rewards=...)`` after each step; ``note(text)`` for
    events."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True, title: str = "finetune"):
        self.total = total_steps
        self.enabled = enabled
        self._rich: Any = None
        self._task: Any = None
        self._last_line = start_step
        self._every = max(1, total_steps // 20)
        self._t0 = time.monotonic()
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}{task.fields[rewards]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
            )
            self._rich.start()
            self._task = self._rich.add_task(title, total=total_steps, completed=start_step,
                                             loss="-", tps="-", eta="?", rewards="")

    def update(self, step: int, loss: float, tokens_per_s: float, eta_s: float | None,
               rewards: str | None = None) -> None:
        """``rewards``: a preference job's ``format_rewards`` of the step, shown after its loss."""
        if not self.enabled:
            return
        shown = f", {rewards}" if rewards else ""
        if self._rich is not None:
            self._rich.update(self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}",
                              eta=format_eta(eta_s), rewards=shown)
        elif step - self._last_line >= self._every or step == self.total:
            self._last_line = step
            print(f"step {step}/{self.total}  loss {loss:.4f}{shown}  {tokens_per_s:,.0f} tok/s  "
                  f"ETA {format_eta(eta_s)}", flush=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
