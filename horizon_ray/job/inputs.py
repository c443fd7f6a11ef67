"""A job's inputs as every rank reads them: its datasets, its step sampler, its step count and its eval
batches (the leader's runner and the follower ranks of `job/ranks.py` both call `load_data`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizon_ray.job import dpo
from horizon_ray.jobspec import JobSpec


@dataclass
class Data:
    """A job's data as its ranks read it (load_data)."""

    train_ds: Any  # the training split
    eval_ds: Any  # the eval split, or None
    sampler: Any  # StepSampler: the micro-batches of every step, a pure function of the step
    total: int  # optimizer steps of the whole job
    evals: list | None  # eval micro-batches, or None (no eval data)
    schedule: Any = None  # training.schedule with its warmup clamped below the job's steps (ScheduleSpec)


def load_data(spec: JobSpec) -> Data:
    """The job's datasets and step sampler (a step has resources.gpus x grad_accum micro-batches: every
    rank's), its step count and its eval micro-batches."""
    from horizon_ray.data import StepSampler, build_datasets, eval_batches, load_tokenizer
    from horizon_ray.data.formats import layout_of
    from horizon_ray.data.tokenize import with_chat_template

    t = spec.training
    tokenizer = with_chat_template(load_tokenizer(Path(spec.model.tokenizer_path or spec.model.path).expanduser()),
                                   spec.data.chat_template)
    if spec.objective == "dpo":
        train_ds, eval_ds, sampler, evals = dpo.load_data(spec, tokenizer)
        total = total_steps_for(spec, sampler.steps_per_epoch)
        return Data(train_ds, eval_ds, sampler, total, evals, _clamped_schedule(t.schedule, total))
    train_ds, eval_ds = build_datasets(
        spec.data.path, spec.data.format, tokenizer, t.seq_len,
        # eval_path replaces the held-out fraction (the data API takes one or the other)
        eval_fraction=0.0 if spec.data.eval_path else spec.data.eval_fraction,
        eval_path=spec.data.eval_path, seed=t.seed, layout=layout_of(spec.data),
        train_on_inputs=spec.data.train_on_inputs,
    )
    sampler = StepSampler(train_ds, t.seq_len, micro_batch_size=t.micro_batch_size,
                           grad_accum=t.grad_accum * spec.resources.gpus, packing=t.packing, seed=t.seed)
    total = total_steps_for(spec, sampler.steps_per_epoch)
    schedule = _clamped_schedule(t.schedule, total)
    evals = None
    if eval_ds is not None and eval_ds.examples:
        evals = eval_batches(eval_ds, t.seq_len, micro_batch_size=t.micro_batch_size,
                             packing=t.packing)[: spec.eval.max_batches]
    return Data(train_ds, eval_ds, sampler, total, evals, schedule)


def _clamped_schedule(schedule, total: int):
    """The schedule with its warmup below the job's steps: a short run of a spec written for a long one
    (max_steps=3 on the demo's) warms up for all but its last step, and says so."""
    if schedule.warmup_steps < total:
        return schedule
    clamped = schedule.model_copy(update={"warmup_steps": total - 1})
    print(f"warning: training.schedule.warmup_steps {schedule.warmup_steps} is not below the job's {total} "
          f"steps; warming up for {clamped.warmup_steps} instead", flush=True)
    return clamped


def total_steps_for(spec: JobSpec, steps_per_epoch: int) -> int:
    t = spec.training
    candidates = []
    if t.epochs is not None:
        candidates.append(max(1, math.ceil(t.epochs * steps_per_epoch)))
    if t.max_steps is not None:
        candidates.append(t.max_steps)
    return min(candidates)
