"""The OpenAI-compatible API through the real `openai` SDK, unchanged, against a real uvicorn on 127.0.0.1 over
the coordinator's in-process twin (fake node agents train one step per tick, so jobs move while the SDK polls).

Every call a fine-tuning client makes: files.create (multipart, purpose fine-tune), files.list / retrieve /
content / delete, fine_tuning.jobs.create (a catalogue model, training and validation files, hyperparameters,
suffix, seed, method), retrieve, list (cursor pagination), list_events (newest first, cursor), checkpoints.list,
cancel, and models.list; OpenAI's object names, statuses and error shape.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from api.app import create_app
from api.server import running_server
from api.testing import make_testbed

pytestmark = pytest.mark.integration

OPENAI_STATUSES = {"validating_files", "queued", "running", "succeeded", "failed", "cancelled"}


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    bed = make_testbed(root, tenants=("acme", "globex"), quotas={"default": {"max_concurrent_jobs": 8}})
    bed.settings.model_catalogue = {"tiny-1g": bed.root / "models" / "1GiB", "huge": bed.root / "models" / "1TiB"}
    yield bed
    bed.close()


@pytest.fixture(scope="module")
def url(bed):
    with running_server(create_app(bed.client, bed.settings)) as url:
        yield url


def sdk(url, bed, tenant="acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=bed.keys[tenant], max_retries=0, timeout=30)


def jsonl(n: int, start: int = 0) -> bytes:
    rows = [{"messages": [{"role": "user", "content": f"add {i} and {i}"},
                          {"role": "assistant", "content": str(2 * i)}]} for i in range(start, start + n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def wait_for(fn, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {fn}"
        time.sleep(0.05)


def test_files_upload_as_multipart_and_list_retrieve_download_delete(url, bed):
    client = sdk(url, bed)
    f = client.files.create(file=("train.jsonl", jsonl(12)), purpose="fine-tune")
    assert isinstance(f, openai.types.FileObject)
    assert f.object == "file" and f.purpose == "fine-tune" and f.filename == "train.jsonl" and f.id.startswith("file-")
    assert f.bytes == len(jsonl(12)) and f.status == "processed"
    assert f.model_extra["num_examples"] == 12 and f.model_extra["format"] == "messages"
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == jsonl(12)
    other = client.files.create(file=("more.jsonl", jsonl(4)), purpose="fine-tune")
    assert [x.id for x in client.files.list()] == [other.id, f.id]  # newest first, as OpenAI lists them
    page = client.files.list(limit=1)
    assert [x.id for x in page.data] == [other.id] and page.has_more
    assert [x.id for x in page.get_next_page().data] == [f.id]
    deleted = client.files.delete(other.id)
    assert deleted.deleted and deleted.id == other.id and deleted.object == "file"
    with pytest.raises(openai.NotFoundError) as info:
        client.files.retrieve(other.id)
    assert info.value.body["code"] == "not_found" and info.value.body["type"] == "invalid_request_error"
    # another tenant sees none of it
    with pytest.raises(openai.NotFoundError):
        sdk(url, bed, "globex").files.retrieve(f.id)


def test_an_upload_states_what_the_dataset_holds(url, bed):
    """Examples always; with a tokenizer named (a catalogue model), its tokens and a histogram of lengths."""
    from horizon_ray.data import build_demo_tokenizer, load_tokenizer

    build_demo_tokenizer(bed.root / "models" / "1GiB")  # the catalogue's tiny-1g gets the demo's tokenizer
    client = sdk(url, bed)
    plain = client.files.create(file=("a.jsonl", jsonl(5)), purpose="fine-tune")
    assert plain.model_extra["stats"]["examples"] == 5 and plain.model_extra["stats"]["tokens"] is None
    f = client.files.create(file=("b.jsonl", jsonl(20)), purpose="fine-tune", extra_body={"tokenizer": "tiny-1g"})
    stats = f.model_extra["stats"]
    tok = load_tokenizer(bed.root / "models" / "1GiB")
    lengths = [len(tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True)
                   ["input_ids"]) for line in jsonl(20).decode().splitlines()]
    assert stats["examples"] == 20 and stats["tokens"] == sum(lengths) and stats["max_tokens"] == max(lengths)
    assert stats["tokenizer"] == "1GiB" and 0 < stats["trained_tokens"] < stats["tokens"]
    assert sum(b["count"] for b in stats["length_histogram"]) == 20
    assert all(b["lo"] <= n < b["hi"] for n in lengths for b in stats["length_histogram"] if b["lo"] <= n < b["hi"])
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("c.jsonl", jsonl(2)), purpose="fine-tune", extra_body={"tokenizer": "../etc"})
    assert info.value.body["param"] == "tokenizer"


def test_a_malformed_upload_is_a_400_naming_the_line(url, bed):
    client = sdk(url, bed)
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("bad.jsonl", jsonl(2) + b'{"messages": [\n'), purpose="fine-tune")
    err = info.value.body
    assert err["code"] == "invalid_file" and "bad.jsonl:3" in err["message"] and err["param"] == "body"
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("x.jsonl", jsonl(2)), purpose="batch")
    assert info.value.body["param"] == "purpose"


def test_a_job_created_with_openai_parameters_runs_to_succeeded(url, bed):
    client = sdk(url, bed)
    train = client.files.create(file=("train.jsonl", jsonl(16)), purpose="fine-tune")
    valid = client.files.create(file=("valid.jsonl", jsonl(4, start=100)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-1g", training_file=train.id, validation_file=valid.id,
        hyperparameters={"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 0.5}, suffix="adder",
        seed=7, method={"type": "supervised"}, extra_body={"spec": {"training": {"max_steps": 6, "seq_len": 64},
                                                                     "checkpoint": {"every_steps": 2}}})
    assert isinstance(job, openai.types.fine_tuning.FineTuningJob)
    assert job.object == "fine_tuning.job" and job.model == "tiny-1g" and job.status in OPENAI_STATUSES
    assert job.training_file == train.id and job.validation_file == valid.id and job.seed == 7
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 4
    assert job.hyperparameters.learning_rate_multiplier == 0.5
    assert job.user_provided_suffix == "adder" and job.organization_id == "acme" and job.fine_tuned_model is None
    # the same job in the native API: the mapping, spelled out
    native = bed.client.get("acme", job.id)
    assert native.spec["training"]["epochs"] == 2 and native.spec["training"]["micro_batch_size"] == 4
    assert native.spec["training"]["packing"] is False and native.spec["training"]["lr"] == pytest.approx(1e-5)
    assert native.spec["data"]["eval_path"].endswith(f"{valid.id}.jsonl") and native.name == "adder"

    done = wait_for(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status == "succeeded" and j)
    assert done.finished_at >= done.created_at and done.error is None
    assert done.fine_tuned_model == f"ft:tiny-1g:acme:adder:{job.id}"
    assert done.model_extra["final_model_url"] == f"/finetune/{job.id}/outputs/final.tar"

    events = client.fine_tuning.jobs.list_events(job.id, limit=5)
    assert len(events.data) == 5 and events.has_more
    assert all(e.object == "fine_tuning.job.event" and e.level in ("info", "warn", "error") for e in events.data)
    assert events.data[0].message.startswith("The job has successfully completed")  # newest first
    everything = list(client.fine_tuning.jobs.list_events(job.id, limit=5))  # the SDK pages with after=
    assert len({e.id for e in everything}) == len(everything) > 5
    assert [e.created_at for e in everything] == sorted((e.created_at for e in everything), reverse=True)
    steps = [e for e in everything if e.type == "metrics" and "training loss" in e.message]
    assert steps and steps[-1].message.startswith("Step 1/6: training loss=") and steps[-1].data["train_loss"]

    ckpts = client.fine_tuning.jobs.checkpoints.list(job.id)
    kept = [c.step for c in bed.client.checkpoints("acme", job.id)]
    assert len(kept) == 3 and [c.step_number for c in ckpts.data] == kept[::-1]  # newest first (OpenAI keeps 3)
    assert all(c.object == "fine_tuning.job.checkpoint" and c.fine_tuning_job_id == job.id for c in ckpts.data)
    assert ckpts.data[0].metrics.train_loss is not None


def preference_jsonl(n: int) -> bytes:
    """OpenAI's preference format."""
    rows = [{"input": {"messages": [{"role": "user", "content": f"add {i} and {i}"}]},
             "preferred_output": [{"role": "assistant", "content": str(2 * i)}],
             "non_preferred_output": [{"role": "assistant", "content": str(2 * i + 1)}]} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_a_dpo_job_maps_onto_objective_dpo(url, bed):
    client = sdk(url, bed)
    train = client.files.create(file=("pairs.jsonl", preference_jsonl(12)), purpose="fine-tune")
    assert train.model_extra["format"] == "preference" and train.model_extra["num_examples"] == 12
    job = client.fine_tuning.jobs.create(
        model="tiny-1g", training_file=train.id, suffix="aligned",
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.25, "batch_size": 3, "n_epochs": 1}}},
        extra_body={"spec": {"training": {"max_steps": 3, "seq_len": 64}}})
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.25
    assert job.method.dpo.hyperparameters.batch_size == 3 and job.hyperparameters.n_epochs == 1
    native = bed.client.get("acme", job.id)
    assert native.spec["objective"] == "dpo" and native.spec["dpo"]["beta"] == 0.25
    assert native.spec["training"]["micro_batch_size"] == 6 and native.spec["training"]["packing"] is False
    assert wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).status == "succeeded")
    with pytest.raises(openai.BadRequestError) as info:  # the engine's rules, named in OpenAI's error shape
        client.fine_tuning.jobs.create(model="tiny-1g", training_file=train.id,
                                       method={"type": "dpo", "dpo": {"hyperparameters": {"beta": -1}}})
    assert info.value.body["param"] == "method.dpo.hyperparameters.beta"
    client.close()  # its connections, not left for the garbage collector to warn about in a later test


def test_jobs_list_pages_with_the_after_cursor(url, bed):
    client = sdk(url, bed, "globex")
    train = client.files.create(file=("t.jsonl", jsonl(8)), purpose="fine-tune")
    made = [client.fine_tuning.jobs.create(model="tiny-1g", training_file=train.id,
                                           extra_body={"spec": {"training": {"max_steps": 50}}}).id
            for _ in range(5)]
    page = client.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in page.data] == made[::-1][:2] and page.has_more
    assert [j.id for j in client.fine_tuning.jobs.list(limit=2)] == made[::-1]  # auto-pagination follows after=
    cancelled = client.fine_tuning.jobs.cancel(made[0])
    assert cancelled.id == made[0] and cancelled.status in ("running", "cancelled")
    assert wait_for(lambda: client.fine_tuning.jobs.retrieve(made[0]).status == "cancelled")
    for job_id in made[1:]:
        client.fine_tuning.jobs.cancel(job_id)


def test_refusals_come_in_openai_error_shape(url, bed):
    client = sdk(url, bed)
    train = client.files.create(file=("t.jsonl", jsonl(8)), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError) as info:
        client.fine_tuning.jobs.create(model="tiny-1", training_file=train.id)
    err = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "did you mean 'tiny-1g'" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.jobs.create(model="tiny-1g", training_file=train.id, method={"type": "reinforcement"})
    assert info.value.body["param"] == "method.type"
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.jobs.create(model="tiny-1g", training_file="file-" + "0" * 24)
    assert info.value.body["code"] == "file_not_found" and info.value.body["param"] == "training_file"  # OpenAI's name
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.jobs.create(model="tiny-1g", training_file=train.id, hyperparameters={"n_epochs": 0})
    assert info.value.body["param"] == "hyperparameters.n_epochs"
    with pytest.raises(openai.BadRequestError) as info:  # no node can ever hold a 1 TiB model
        client.fine_tuning.jobs.create(model="huge", training_file=train.id)
    assert info.value.body["code"] == "rejected" and "no node can ever hold this job" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.fine_tuning.jobs.retrieve("job-000000000000")
    assert set(info.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).fine_tuning.jobs.list()
    assert info.value.body["type"] == "authentication_error"
    assert [m.id for m in client.models.list()] == ["huge", "tiny-1g"]
