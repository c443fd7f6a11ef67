"""Learning-rate schedules: warmup, then constant / linear / cosine decay to min_lr_ratio."""

import math

import pytest

from horizon_ray.job.schedule import lr_at
from horizon_ray.jobspec import ScheduleSpec


def _curve(kind, total=100, warmup=10, floor=0.0, peak=1.0):
    sched = ScheduleSpec(type=kind, warmup_steps=warmup, min_lr_ratio=floor)
    return [lr_at(s, total, peak, sched) for s in range(total)]


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_warmup_rises_linearly_to_the_peak(kind):
    lrs = _curve(kind, peak=2.0)
    assert lrs[:10] == pytest.approx([2.0 * (s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(2.0)
    assert all(0 < lr <= 2.0 for lr in lrs)


def test_constant_stays_at_the_peak():
    assert _curve("constant", warmup=0) == [1.0] * 100


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decay_is_monotone_and_ends_near_the_floor(kind):
    lrs = _curve(kind, floor=0.1)
    after = lrs[10:]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert after[-1] == pytest.approx(0.1, abs=0.02)
    assert after[-1] > 0.1


def test_cosine_midpoint_and_linear_shape():
    cos = _curve("cosine", total=101, warmup=1)
    assert cos[51] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    lin = _curve("linear", total=100, warmup=0)
    assert lin[50] == pytest.approx(0.5)


def test_step_outside_the_run_is_a_bug():
    with pytest.raises(AssertionError):
        lr_at(10, 10, 1.0, ScheduleSpec())
