"""Learning rate as a pure function of the step, so that a resumed job sets exactly the same rates."""

from __future__ import annotations

import math

from horizon_ray.jobspec import ScheduleSpec


def lr_at(step: int, total_steps: int, peak_lr: float, schedule: ScheduleSpec) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Linear warmup over ``warmup_steps`` (step 0 already trains, at peak / warmup_steps), then constant,
    or a linear / cosine decay that reaches ``min_lr_ratio * peak`` at the end of the run.
    """
    assert 0 <= step < total_steps, (step, total_steps)
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    if schedule.type == "constant":
        return peak_lr
    progress = (step - warmup) / max(1, total_steps - warmup)
    if schedule.type == "linear":
        factor = 1.0 - progress
    elif schedule.type == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise AssertionError(f"unknown schedule {schedule.type!r}")
    floor = schedule.min_lr_ratio
    return peak_lr * (floor + (1.0 - floor) * factor)
