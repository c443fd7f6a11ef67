"""The fine-tuning job: one spec in, metrics, checkpoints and an HF model out (``horizon-ray finetune``).

    from horizon_ray.job import run_job
    result = run_job(spec, resume=True)      # spec: horizon_ray.jobspec.JobSpec

Modules: ``runner`` (the step loop), ``checkpoints`` (atomic, resumable training state), ``metrics``
(metrics.jsonl and the loss curve), ``schedule`` (learning rate per step), ``progress`` (terminal
progress), ``demo`` (the embedded demo model, tokenizer and dataset).
"""

from horizon_ray.job.runner import JobResult, JobTerminated, OutputDirBusy, run_job

__all__ = ["JobResult", "JobTerminated", "OutputDirBusy", "run_job"]
