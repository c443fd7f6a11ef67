"""The parts of a job that objective dpo changes: its data (preference pairs), its reference pass, its steps'
inputs and its evaluation. The runner's loop stays one loop; it asks this module where the objectives differ."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from horizon_ray.job import reference
from horizon_ray.jobspec import JobSpec


def load_data(spec: JobSpec, tokenizer: Any) -> tuple[Any, Any, Any, list | None]:
    """(train rows, eval rows or None, PairSampler, eval micro-batches or None) of a preference job."""
    from horizon_ray.data.build import split_examples
    from horizon_ray.data.pairs import PairSampler, pair_batches, tokenize_pairs
    from horizon_ray.data.preference import load_pairs

    t, d = spec.training, spec.data
    pairs = load_pairs(d.path, d.format)
    eval_pairs = None
    if d.eval_path:
        eval_pairs = load_pairs(d.eval_path, d.format)
    elif d.eval_fraction > 0:
        pairs, eval_pairs = split_examples(pairs, d.eval_fraction, t.seed)
    train_ds = tokenize_pairs(pairs, tokenizer, t.seq_len)
    eval_ds = tokenize_pairs(eval_pairs, tokenizer, t.seq_len) if eval_pairs else None
    # a step has resources.gpus x grad_accum micro-batches: every rank's (job/ranks.py takes each its share)
    sampler = PairSampler(train_ds, t.micro_batch_size, t.grad_accum * spec.resources.gpus, t.seed)
    evals = None
    if eval_ds is not None:
        evals = pair_batches(eval_ds, list(range(len(eval_ds.examples))), t.micro_batch_size)[: spec.eval.max_batches]
    return train_ds, eval_ds, sampler, evals


class Preference:
    """A preference job's reference log-probs and how its steps and evaluations use them."""

    def __init__(self, spec: JobSpec, out: Path, train_ds: Any, eval_ds: Any, sampler: Any, evals: list | None):
        from horizon_ray.data.pairs import data_hash

        assert spec.dpo is not None, "JobSpec gives objective dpo its section"
        self.config = spec.dpo.config()
        self.out = out
        self.sampler = sampler
        self.evals = evals or []
        hashes = [data_hash(train_ds)] + ([data_hash(eval_ds)] if eval_ds is not None else [])
        self.hash = reference.reference_hash(spec, hashes)
        self.logps: dict[str, torch.Tensor] | None = None

    def prepare(self, eng: Any, step: int, commit: Any, note: Any) -> None:
        """The reference: read from the output directory, or (at step 0 only) computed with the engine's
        starting weights, resuming a pass a kill cut short."""
        self.logps = reference.load(self.out, self.hash)
        if self.logps is not None:
            return
        if step > 0:
            reference.required(self.out, self.hash, step)
        train = self.sampler.dataset
        from horizon_ray.data.pairs import pair_batches

        splits = {"train": pair_batches(train, list(range(len(train.examples))), self.sampler.micro_batch_size)}
        if self.evals:
            splits["eval"] = self.evals

        def progress(split: str, done: int, total: int) -> None:
            note(f"reference pass ({split}): {done}/{total} micro-batches")

        self.logps = reference.compute(self.out, self.hash, splits, eng.sequence_logps, commit, progress)

    def wait_for_reference(self, alive: Any, poll_s: float = 0.5) -> None:
        """A follower rank's reference: the one the leader computes (or finds) before its first step, read once
        the leader has written it; ``alive()`` false (the leader is gone) ends the wait with an error."""
        while (logps := reference.load(self.out, self.hash)) is None:
            if not alive():
                raise RuntimeError("the job's leader ended before it wrote the reference log-probs")
            time.sleep(poll_s)
        self.logps = logps

    def train_step(self, eng: Any, step: int, batches: list, rank: int = 0, world: int = 1) -> float:
        """Rank ``rank``'s share of the step (its ``batches``, as ranks.my_batches cut them): the reference
        log-probs of its rows."""
        assert self.logps is not None, "prepare() or wait_for_reference() comes first"
        rows = self.sampler.rows_for_step(step)
        per = len(rows) // world
        ref = self.logps["train"][rows[rank * per:(rank + 1) * per]]
        return float(eng.train_step(batches, dpo=self.config, ref_logps=ref))

    def evaluate(self, eng: Any) -> Any:
        """The metrics' sums over the eval pairs (DpoMetrics)."""
        assert self.logps is not None, "prepare() or wait_for_reference() comes first"
        total, lo = None, 0
        for mb in self.evals:
            rows = int(mb[0].shape[0])
            m = eng.eval_dpo([mb], self.config, self.logps["eval"][lo:lo + rows])
            total = m if total is None else total + m
            lo += rows
        return total
