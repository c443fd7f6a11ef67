"""The objective and the data's format name each other, and a job whose data is for the other objective is
refused when it is submitted (by the job spec, and by the API from what an upload was checked as), never after
it waited in the queue and failed on its node."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.testing import make_testbed
from horizon_ray.errors import BadInput
from horizon_ray.jobspec import JobSpec

PAIRS = [{"prompt": f"copy a{i}", "chosen": f"a{i}", "rejected": f"A{i}"} for i in range(8)]
CHATS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
         for i in range(8)]
DPO = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}}


@pytest.mark.parametrize(("objective", "fmt", "words"), [
    ("dpo", "messages", "objective dpo trains on preference pairs but data.format is 'messages'"),
    ("dpo", "alpaca", "data.format is 'alpaca'"),
    ("sft", "preference", "data.format is preference but objective is sft"),
])
def test_the_job_spec_refuses_data_of_the_other_objective(objective, fmt, words):
    spec = {"model": {"path": "/m"}, "data": {"path": "/d.jsonl", "format": fmt}, "objective": objective,
            "training": {"micro_batch_size": 2, "max_steps": 1}, "output_dir": "/o"}
    with pytest.raises(BadInput, match=words) as exc:
        JobSpec.from_dict(spec)
    assert exc.value.field == "data.format"
    JobSpec.from_dict({**spec, "data": {"path": "/d.jsonl", "format": "auto"}})  # detected from the file instead


@pytest.fixture
def api(tmp_path):
    bed = make_testbed(tmp_path, quotas={"default": {"max_concurrent_jobs": 8}})
    bed.settings.model_catalogue = {"tiny-1g": bed.root / "models" / "1GiB"}
    with TestClient(create_app(bed.client, bed.settings)) as http:
        def upload(rows):
            r = http.post("/v1/files", headers=bed.auth("acme"), data={"purpose": "fine-tune"},
                          files={"file": ("t.jsonl", "".join(json.dumps(x) + "\n" for x in rows).encode())})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        yield http, bed, upload
    bed.close()


@pytest.mark.parametrize(("rows", "method", "words"), [
    (CHATS, DPO, "holds 'messages' data (checked when it was uploaded), but objective dpo trains on preference"),
    (PAIRS, None, "holds 'preference' data (checked when it was uploaded), but objective sft trains on demo"),
])
def test_an_upload_for_the_other_objective_is_refused_at_create(api, rows, method, words):
    # before: both were created (running, holding a slot) and failed on the node when it read the file
    http, bed, upload = api
    body = {"model": "tiny-1g", "training_file": upload(rows), **({"method": method} if method else {})}
    r = http.post("/v1/fine_tuning/jobs", headers=bed.auth("acme"), json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # named by OpenAI's parameter, as the request gave it (the check is the job spec's, shared with /finetune)
    assert words in err["message"] and err["param"] == "training_file"
    assert "data.path" not in err["message"]
    spec = {"model": {"path": "tiny-1g"}, "data": {"path": body["training_file"]}, "output_dir": "o",
            "training": {"micro_batch_size": 2, "max_steps": 1}, **({"objective": "dpo"} if method else {})}
    r = http.post("/finetune", headers=bed.auth("acme"), json=spec)
    assert r.status_code == 422 and words in r.json()["error"]["message"]
    assert bed.client.list("acme", limit=10)[0] == []  # no job was made
    ok = {**body, "method": DPO} if not method else {**body, "training_file": upload(PAIRS)}
    assert http.post("/v1/fine_tuning/jobs", headers=bed.auth("acme"), json=ok).status_code == 200


@pytest.mark.parametrize(("hyper", "param", "words"), [
    # before: "method.dpo.hyperparameters.beta.literal['auto']: Input should be 'auto'", as if only auto were valid
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": "high"}}}}, "method.dpo.hyperparameters.beta",
     "method.dpo.hyperparameters.beta is 'high'; give a number, or auto"),
    ({"hyperparameters": {"n_epochs": "many"}}, "hyperparameters.n_epochs",
     "hyperparameters.n_epochs is 'many'; give an integer, or auto"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"betta": 0.2}}}}, "method.dpo.hyperparameters.betta",
     "did you mean 'method.dpo.hyperparameters.beta'?"),
    ({"hyperparameters": {"quantize": "q4"}}, "hyperparameters.quantize", "use one of none, nf4, fp4, int8"),
])
def test_openai_create_names_a_bad_hyperparameter_and_what_it_takes(api, hyper, param, words):
    http, bed, upload = api
    r = http.post("/v1/fine_tuning/jobs", headers=bed.auth("acme"),
                  json={"model": "tiny-1g", "training_file": upload(PAIRS), **hyper})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "literal[" not in err["message"]


@pytest.mark.parametrize(("extra", "key"), [
    ({"data": {"path": "/d.jsonl", "columns": {"messages": "dialog"}}}, "data.columns"),
    ({"data": {"path": "/d.jsonl", "roles": {"bot": "assistant"}}}, "data.roles"),
    ({"data": {"path": "/d.jsonl", "train_on_inputs": True}}, "data.train_on_inputs"),
    ({"eval": {"every_steps": 5, "generate": {"max_tokens": 8}}}, "eval.generate"),
])
def test_sft_only_settings_on_a_dpo_job_are_refused_not_ignored(extra, key):
    # before: accepted, and the DPO job ran as if they were not there
    spec = {"model": {"path": "/m"}, "data": {"path": "/d.jsonl"}, "objective": "dpo",
            "training": {"micro_batch_size": 2, "max_steps": 1}, "output_dir": "/o"}
    with pytest.raises(BadInput, match=f"{key} applies to SFT data, and objective dpo has no use for it") as exc:
        JobSpec.from_dict({**spec, **extra})
    assert exc.value.field == key
    JobSpec.from_dict({**spec, **extra, "objective": "sft"})  # SFT takes each
    JobSpec.from_dict({**spec, "data": {"path": "/d.jsonl", "chat_template": "chatml"}})  # the pairs' messages use it


def test_a_dpo_job_object_counts_pairs_everywhere_and_its_events_carry_the_rewards(api):
    """The job object gives one batch size, in pairs as the create request counts them (before: the top-level
    hyperparameters said 6 rows where method.dpo's said 3 pairs), and its metrics events say the reward accuracy
    and margin in words, as the terminal does (before: the loss alone)."""
    import time

    http, bed, upload = api
    body = {"model": "tiny-1g", "training_file": upload(PAIRS),
            "method": {"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 3, "n_epochs": 1}}}}
    r = http.post("/v1/fine_tuning/jobs", headers=bed.auth("acme"), json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["hyperparameters"]["batch_size"] == job["method"]["dpo"]["hyperparameters"]["batch_size"] == 3
    assert bed.client.get("acme", job["id"]).spec["training"]["micro_batch_size"] == 6
    deadline = time.monotonic() + 30
    while http.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bed.auth("acme")).json()["status"] != "succeeded":
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.1)
    events = http.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=bed.auth("acme")).json()["data"]
    metrics = [e["message"] for e in events if e["type"] == "metrics"]
    assert metrics and all(", reward accuracy " in m and ", margin " in m for m in metrics)
    assert any(m.startswith("Step ") and "validation loss=" in m for m in metrics)
