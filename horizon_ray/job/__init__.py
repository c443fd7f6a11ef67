"""The fine-tuning job: one spec in, events, checkpoints and an HF model out (``horizon-ray finetune``).

    from horizon_ray.job.runner import run_job
    result = run_job(spec, resume=True)      # spec: horizon_ray.jobspec.JobSpec

Modules: ``runner`` (the step loop), ``events`` (what a run reports, line by line: the protocol with the
cluster; plain Python, which the cluster imports without torch), ``checkpoints`` (atomic, resumable
training state), ``metrics`` (metrics.jsonl and the loss curve), ``schedule`` (learning rate per step),
``progress`` (terminal progress), ``demo`` (the embedded demo model, tokenizer and dataset).
``python -m horizon_ray.job`` is the node agent's child process.
"""
