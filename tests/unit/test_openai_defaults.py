"""The OpenAI route's defaults keep what a user expects of a fine-tuning job: checkpoints at a cadence and at the
final step, trained_tokens, a result file (the job's metrics) and, for a refusal, every node's verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.openai import CHECKPOINT_EVERY, CHECKPOINT_KEEP, job_object, result_file_id, result_job_id
from api.testing import make_testbed
from horizon_ray.cluster.messages import JobStatus


@pytest.fixture
def bed(tmp_path):
    bed = make_testbed(tmp_path, quotas={"default": {"max_concurrent_jobs": 8}})
    bed.settings.model_catalogue = {"tiny-1g": bed.root / "models" / "1GiB", "huge": bed.root / "models" / "1TiB"}
    yield bed
    bed.close()


@pytest.fixture
def http(bed):
    with TestClient(create_app(bed.client, bed.settings)) as c:
        yield c


def _upload(http, bed, tenant="acme") -> str:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(8)]
    r = http.post("/v1/files", headers=bed.auth(tenant), data={"purpose": "fine-tune"},
                  files={"file": ("t.jsonl", "".join(json.dumps(x) + "\n" for x in rows).encode())})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_a_job_created_here_checkpoints_lists_its_final_step_and_its_result_file(http, bed):
    train = _upload(http, bed)
    r = http.post("/v1/fine_tuning/jobs", headers=bed.auth("acme"), json={
        "model": "tiny-1g", "training_file": train, "spec": {"training": {"max_steps": 250}}})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["result_files"] == [] and job["trained_tokens"] is None
    native = bed.client.get("acme", job["id"])
    assert native.spec["checkpoint"] == {"every_steps": CHECKPOINT_EVERY, "keep": CHECKPOINT_KEEP} == \
        {"every_steps": 100, "keep": 3}
    bed.agent(native.node_id).advance(job["id"], 250)
    record = bed.client.get("acme", job["id"])
    assert record.status is JobStatus.SUCCEEDED
    ckpts = http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints", headers=bed.auth("acme")).json()["data"]
    assert [c["step_number"] for c in ckpts] == [250, 200, 100][:len(ckpts)] and ckpts[0]["step_number"] == 250
    assert ckpts[0]["id"] == f"ftckpt-{job['id']}-250"

    done = http.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bed.auth("acme")).json()
    rid = result_file_id(job["id"])
    assert done["result_files"] == [rid] and result_job_id(rid) == job["id"] and result_job_id(train) is None
    out = Path(record.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text('{"type": "metrics", "step": 1}\n')
    meta = http.get(f"/v1/files/{rid}", headers=bed.auth("acme")).json()
    assert (meta["purpose"], meta["filename"], meta["bytes"]) == ("fine-tune-results", "metrics.jsonl", 31)
    content = http.get(f"/v1/files/{rid}/content", headers=bed.auth("acme"))
    assert content.status_code == 200 and content.content == (out / "metrics.jsonl").read_bytes()
    assert http.get(f"/v1/files/{rid}/content", headers=bed.auth("globex")).status_code == 404  # not theirs


def test_trained_tokens_are_the_runners_count():
    from horizon_ray.cluster.messages import JobRecord

    record = JobRecord(id="job-0123456789ab", tenant="acme", name=None, status=JobStatus.SUCCEEDED, priority=0,
                       created_at=1.0, spec={}, metrics={"step": 3, "tokens_seen": 1234})

    class _Tenant:  # job_object reads only the tenant's catalogue
        class settings:  # noqa: N801
            model_catalogue: dict = {}

    assert job_object(record, _Tenant)["trained_tokens"] == 1234


def test_a_placement_refusal_keeps_every_nodes_verdict(http, bed):
    train = _upload(http, bed)
    r = http.post("/v1/fine_tuning/jobs", headers=bed.auth("acme"), json={"model": "huge", "training_file": train})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "rejected" and "no node can ever hold this job" in err["message"]
    nodes = {n["node_id"]: n["reason"] for n in err["details"]["nodes"]}
    assert set(nodes) == {"a", "b"} and all("host RAM" in why for why in nodes.values()), nodes
