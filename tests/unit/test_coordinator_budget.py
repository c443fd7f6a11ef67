"""A tenant's cap on tokens per job counts a step's tokens with the spec's own defaults (TrainingSpec,
ResourcesSpec), never with defaults of the coordinator's: before, a key the spec left out counted as 1."""

import pytest

from horizon_ray.cluster.coordinator import Coordinator
from horizon_ray.cluster.errors import QuotaExceeded
from horizon_ray.cluster.tenants import TenantsConfig
from horizon_ray.jobspec import ResourcesSpec, TrainingSpec


def coordinator(tmp_path, max_tokens: int) -> Coordinator:
    # the spec as given (no defaults filled in), as a validator other than JobSpec's leaves it
    return Coordinator(store_path=tmp_path / "jobs.db", jobs_root=tmp_path / "jobs", agents={},
                       validate_spec=dict,
                       tenants=TenantsConfig.from_dict({"tenants": {"acme": {"max_tokens_per_job": max_tokens}}}))


def test_the_token_cap_counts_a_step_with_the_specs_defaults(tmp_path):
    t = TrainingSpec()
    per_step = t.seq_len * t.micro_batch_size * t.grad_accum * ResourcesSpec().gpus
    assert per_step > 1  # what the spec's defaults make a step: the old count took 1
    spec = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "training": {"max_steps": 10}}
    with pytest.raises(QuotaExceeded, match=f"would train on {10 * per_step} tokens \\(10 steps of {per_step}\\)"):
        coordinator(tmp_path / "a", max_tokens=10 * per_step - 1).submit("acme", spec)
    assert coordinator(tmp_path / "b", max_tokens=10 * per_step).submit("acme", spec).tenant == "acme"
    # a key the spec gives counts as given
    two_gpus = {**spec, "resources": {"gpus": 2}, "training": {"max_steps": 10, "seq_len": 8, "micro_batch_size": 1,
                                                                 "grad_accum": 1}}
    with pytest.raises(QuotaExceeded, match="would train on 160 tokens \\(10 steps of 16\\)"):
        coordinator(tmp_path / "c", max_tokens=159).submit("acme", two_gpus)
