"""Every number a job spec holds is finite and bounded, so that every job ends: a number too large for its type
is a 422 naming the field (it was a 500), a step or epoch count past the spec's bound is refused, and a tenant's
own caps on steps and tokens per job (the tenants file) hold at submit. In-process, over the testbed."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.testing import make_testbed
from horizon_ray.jobspec import MAX_EPOCHS, MAX_STEPS

QUOTAS = {"tenants": {"acme": {"max_steps_per_job": 100, "max_tokens_per_job": 100 * 64 * 4}}}


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    bed = make_testbed(tmp_path_factory.mktemp("budgets"), quotas=QUOTAS)
    yield bed
    bed.close()


@pytest.fixture(scope="module")
def http(bed):
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as c:
        yield c


def post_raw(http, bed, tenant, training: str):
    """POST /finetune with `training` spliced in as raw JSON (numbers JSON holds and Python's json.dumps would
    not write: 10**400, NaN)."""
    body = '{"model": {"path": "1GiB"}, "data": {"path": "demo.jsonl"}, "training": {' + training + "}}"
    return http.post("/finetune", content=body, headers={**bed.auth(tenant), "Content-Type": "application/json"})


@pytest.mark.parametrize("training,field,says", [
    ('"max_steps": 5, "lr": 1' + "0" * 400, "training.lr", "too large for a floating-point number"),
    ('"max_steps": 5, "lr": NaN', "training.lr", "not a finite number"),
    ('"max_steps": 5, "weight_decay": Infinity', "training.weight_decay", "not a finite number"),
    ('"max_steps": 1e30', "training.max_steps", "too large"),
    ('"max_steps": 1' + "0" * 30, "training.max_steps", "too large"),
    (f'"max_steps": {MAX_STEPS + 1}', "training.max_steps", f"{MAX_STEPS}"),
    ('"epochs": 1e308', "training.epochs", f"{MAX_EPOCHS}"),
    ('"max_steps": 5, "seed": 1' + "0" * 25, "training.seed", "too large"),
])
def test_a_number_past_its_type_or_bound_is_422_naming_the_field(http, bed, training, field, says):
    r = post_raw(http, bed, "globex", training)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_spec" and err["field"] == field and says in err["message"], err
    assert post_raw(http, bed, "globex", '"max_steps": 5').status_code == 201  # the connection serves on


def test_a_tenants_caps_on_steps_and_tokens_per_job_hold_at_submit(http, bed):
    too_many = post_raw(http, bed, "acme", '"max_steps": 101, "seq_len": 16, "micro_batch_size": 1')
    assert too_many.status_code == 429, too_many.text
    err = too_many.json()["error"]
    assert err["code"] == "quota_exceeded" and "at most 100 steps a job" in err["message"]
    # 100 steps of 64 x 8 tokens: twice the tenant's 25,600
    tokens = post_raw(http, bed, "acme", '"max_steps": 100, "seq_len": 64, "micro_batch_size": 8')
    assert tokens.status_code == 429 and "51200 tokens" in tokens.json()["error"]["message"], tokens.text
    epochs_only = post_raw(http, bed, "acme", '"epochs": 1, "seq_len": 16')
    assert epochs_only.status_code == 429 and "set training.max_steps" in epochs_only.json()["error"]["message"]
    within = post_raw(http, bed, "acme", '"max_steps": 100, "seq_len": 64, "micro_batch_size": 4')
    assert within.status_code == 201, within.text
    # another tenant has no caps of its own: the spec's bounds only
    assert post_raw(http, bed, "globex", '"epochs": 1, "seq_len": 16').status_code == 201
    listed = http.get("/finetune", headers=bed.auth("acme")).json()["data"]
    assert [j["spec"]["training"]["max_steps"] for j in listed] == [100]  # the refused ones left nothing


def test_the_tenants_file_takes_the_caps_and_refuses_a_bad_one():
    from horizon_ray.cluster.tenants import TenantsConfig
    from horizon_ray.errors import BadInput

    config = TenantsConfig.from_dict({"default": {"max_tokens_per_job": 10**9}, **QUOTAS})
    assert (config.quota("acme").max_steps_per_job, config.quota("acme").max_tokens_per_job) == (100, 25600)
    assert (config.quota("other").max_steps_per_job, config.quota("other").max_tokens_per_job) == (None, 10**9)
    with pytest.raises(BadInput, match="max_steps_per_job is 0; set a positive integer"):
        TenantsConfig.from_dict({"default": {"max_steps_per_job": 0}})
