"""The fine-tuning job: one spec in, events, checkpoints and an HF model out (``horizon-ray finetune``).

    from horizon_ray.job import run_job
    result = run_job(spec, resume=True)      # spec: horizon_ray.jobspec.JobSpec

Modules: ``runner`` (the step loop), ``events`` (what a run reports, line by line: the protocol with the
cluster), ``checkpoints`` (atomic, resumable training state), ``metrics`` (metrics.jsonl and the loss
curve), ``schedule`` (learning rate per step), ``progress`` (terminal progress), ``demo`` (the embedded demo
model, tokenizer and dataset). ``python -m horizon_ray.job`` is the node agent's child process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from horizon_ray.job.runner import JobResult, JobTerminated, OutputDirBusy, run_job

# Imported on first use, so that horizon_ray.job.events (plain Python) loads without torch for the cluster.
_EXPORTS = {"JobResult": "runner", "JobTerminated": "runner", "OutputDirBusy": "runner", "run_job": "runner"}
__all__ = ["JobResult", "JobTerminated", "OutputDirBusy", "run_job"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"horizon_ray.job.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'horizon_ray.job' has no attribute {name!r}")
