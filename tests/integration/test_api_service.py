"""The REST API through a real uvicorn on 127.0.0.1, with httpx, over the coordinator's in-process twin.

Fake node agents train one step per coordinator tick (the in-process client ticks on every call), so a job
moves while the test polls it.
"""

import json
import time

import httpx
import pytest

from api.app import create_app
from api.server import running_server
from api.streams import FEED_IDLE_POLL_S
from api.testing import make_testbed

pytestmark = pytest.mark.integration

TENANTS = ("acme", "globex", "pager", "idem", "paths", "files", "canceller", "streamer")
TYPED_EVENTS = {"status", "metrics", "checkpoint", "memory", "error"}


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    bed = make_testbed(tmp_path_factory.mktemp("api"), tenants=TENANTS, nodes={"a": "16GiB", "b": "64GiB"},
                       quotas={"default": {"max_concurrent_jobs": 2}},
                       max_body_bytes=64 * 1024, max_upload_bytes=256 * 1024)
    yield bed
    bed.close()


@pytest.fixture(scope="module")
def url(bed):
    with running_server(create_app(bed.client, bed.settings)) as url:
        yield url


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, timeout=30) as client:
        yield client


def wait_for(fn, timeout=30.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {fn}")
        time.sleep(interval)


def error_of(r, status, code):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert "Traceback" not in r.text
    body = r.json()
    assert list(body) == ["error"] and body["error"]["code"] == code and body["error"]["message"]
    return body["error"]


def submit(http, bed, tenant, spec=None, **headers):
    r = http.post("/finetune", json=spec or bed.spec(), headers={**bed.auth(tenant), **headers})
    assert r.status_code == 201, r.text
    return r.json()


def finished(http, bed, tenant, job_id):
    job = http.get(f"/finetune/{job_id}", headers=bed.auth(tenant)).json()
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


def read_sse(response):
    """(id, event, data) triples of an SSE response, until the server closes it."""
    out, msg = [], {}
    for line in response.iter_lines():
        if not line:
            if "data" in msg:
                out.append((msg.get("id"), msg.get("event", "message"), json.loads(msg["data"])))
            msg = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(":")
            msg[key] = value[1:] if value.startswith(" ") else value
    return out


def write_outputs(job):
    """What the engine would leave in the job's output directory."""
    from pathlib import Path

    out = Path(job["result"]["output_dir"])
    (out / "final").mkdir(parents=True, exist_ok=True)
    (out / "final" / "config.json").write_text('{"model_type": "llama"}')
    (out / "metrics.jsonl").write_text('{"type": "done"}\n')
    (out / "checkpoints" / "step-00000002").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints" / "step-00000002" / "COMPLETE").write_text("")
    return out


# ---- lifecycle -------------------------------------------------------------------------------------------


def test_whole_job_lifecycle(http, bed):
    spec = bed.spec(max_steps=6)
    spec["checkpoint"] = {"every_steps": 2}
    spec["name"] = "first run"
    r = http.post("/finetune", json=spec, headers=bed.auth("acme"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert r.headers["location"] == f"/finetune/{job['id']}"
    assert job["tenant"] == "acme" and job["name"] == "first run"
    assert job["status"] in ("queued", "running")
    assert job["spec"]["model"]["path"] == str(bed.root / "models" / "1GiB")
    assert job["spec"]["data"]["path"] == str(bed.root / "data" / "demo.jsonl")
    assert job["spec"]["output_dir"] == str(bed.settings.outputs_dir("acme") / job["id"])
    assert job["plan"]["host_bytes"] == 2**30
    assert job["created_at"] > 0 and job["error"] is None

    done = wait_for(lambda: finished(http, bed, "acme", job["id"]))
    assert done["status"] == "succeeded"
    assert done["node_id"] in ("a", "b")
    assert done["progress"]["step"] == done["progress"]["total_steps"] == 6
    assert done["progress"]["fraction"] == 1.0 and done["progress"]["tokens_per_s"] > 0
    assert done["metrics"]["loss"] == pytest.approx(1 / 6)
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    assert done["result"]["final_model"] == f"{done['result']['output_dir']}/final"
    assert http.get(r.headers["location"], headers=bed.auth("acme")).json()["status"] == "succeeded"

    events = http.get(f"/finetune/{job['id']}/events", params={"limit": 1000}, headers=bed.auth("acme")).json()
    seqs = [e["seq"] for e in events["data"]]
    assert seqs == list(range(1, len(seqs) + 1)) and not events["has_more"]
    statuses = [e["data"]["to"] for e in events["data"] if e["type"] == "status"]
    assert statuses == ["validating", "queued", "running", "succeeded"]
    steps = [e["data"]["step"] for e in events["data"] if e["type"] == "metrics"]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert {e["type"] for e in events["data"]} <= TYPED_EVENTS

    ckpts = http.get(f"/finetune/{job['id']}/checkpoints", headers=bed.auth("acme")).json()["data"]
    assert [c["step"] for c in ckpts] == [4, 6]  # checkpoint.keep is 2: step 2's was pruned, and is not listed

    write_outputs(done)
    outputs = http.get(f"/finetune/{job['id']}/outputs", headers=bed.auth("acme")).json()
    paths = {f["path"] for f in outputs["data"]}
    assert {"final/config.json", "metrics.jsonl", "checkpoints/step-00000002/COMPLETE"} <= paths
    got = http.get(f"/finetune/{job['id']}/outputs/final/config.json", headers=bed.auth("acme"))
    assert got.status_code == 200 and got.json() == {"model_type": "llama"}
    for bad in ("../../globex", "final/../../../models/1GiB/config.json", "nope.txt", "%2e%2e/%2e%2e/x"):
        error_of(http.get(f"/finetune/{job['id']}/outputs/{bad}", headers=bed.auth("acme")), 404, "not_found")

    seen = http.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=bed.auth("acme")).json()
    assert seen["id"] == job["id"] and seen["status"] == "succeeded" and seen["object"] == "fine_tuning.job"


def test_a_finished_jobs_model_downloads_as_one_streamed_tar(http, bed, tmp_path):
    import io
    import os
    import tarfile

    job = submit(http, bed, "acme", bed.spec(max_steps=2))
    auth = bed.auth("acme")
    assert wait_for(lambda: finished(http, bed, "acme", job["id"]))["status"] == "succeeded"
    assert error_of(http.get(f"/finetune/{job['id']}/outputs/final.tar", headers=auth), 404, "not_found")
    out = write_outputs(job)
    weights = os.urandom(3 * 2**20 + 17)  # several read chunks and a partial tar block
    (out / "final" / "model.safetensors").write_bytes(weights)
    (out / "final" / "tokenizer").mkdir()
    (out / "final" / "tokenizer" / "tokenizer.json").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("not an output")
    (out / "final" / "leak.txt").symlink_to(secret)  # a link out of the job's directory is not an output

    with http.stream("GET", f"/finetune/{job['id']}/outputs/final.tar", headers=auth) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
        assert f'filename="{job["id"]}-final.tar"' in r.headers["content-disposition"]
        body = b"".join(r.iter_bytes())
    assert len(body) == int(r.headers["content-length"])
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = tar.getnames()
        assert tar.extractfile(f"{job['id']}-final/model.safetensors").read() == weights
        assert tar.extractfile(f"{job['id']}-final/config.json").read() == b'{"model_type": "llama"}'
    prefix = f"{job['id']}-final"
    assert sorted(names) == sorted([prefix, f"{prefix}/tokenizer", f"{prefix}/config.json",
                                    f"{prefix}/model.safetensors", f"{prefix}/tokenizer/tokenizer.json"])


def test_cancel_running_queued_and_finished_jobs(http, bed):
    long = bed.spec(max_steps=100_000)
    running = [submit(http, bed, "canceller", long) for _ in range(2)]  # quota: 2 concurrent jobs per tenant
    queued = submit(http, bed, "canceller", long)
    wait_for(lambda: all(http.get(f"/finetune/{j['id']}", headers=bed.auth("canceller")).json()["status"] == "running"
                         for j in running))
    q = http.get(f"/finetune/{queued['id']}", headers=bed.auth("canceller")).json()
    assert q["status"] == "queued" and q["queue"]["position"] >= 1 and q["queue"]["reason"]
    assert queued["id"] in [e["id"] for e in http.get("/queue", headers=bed.auth("canceller")).json()["data"]]

    r = http.post(f"/finetune/{queued['id']}/cancel", headers=bed.auth("canceller"))
    assert r.status_code == 200 and r.json()["status"] == "cancelled"

    for job in running:
        r = http.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=bed.auth("canceller"))
        # OpenAI's statuses: a job stopping is running until its engine has stopped
        assert r.status_code == 200 and r.json()["status"] in ("running", "cancelled")
    for job in running:
        assert wait_for(lambda j=job: finished(http, bed, "canceller", j["id"]))["status"] == "cancelled"
        again = http.post(f"/finetune/{job['id']}/cancel", headers=bed.auth("canceller"))
        assert again.status_code == 200 and again.json()["status"] == "cancelled"

    done = submit(http, bed, "canceller", bed.spec(max_steps=2))
    wait_for(lambda: finished(http, bed, "canceller", done["id"]))
    r = http.post(f"/finetune/{done['id']}/cancel", headers=bed.auth("canceller"))
    err = error_of(r, 409, "invalid_transition")
    assert "succeeded" in err["message"]


def test_pagination_and_status_filter(http, bed):
    long = bed.spec(max_steps=100_000)
    ids = [submit(http, bed, "pager", long)["id"] for _ in range(7)]
    pages, after = [], None
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        page = http.get("/finetune", params=params, headers=bed.auth("pager")).json()
        pages.append(page)
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert [len(p["data"]) for p in pages] == [3, 3, 1]
    listed = [j["id"] for p in pages for j in p["data"]]
    assert listed == ids[::-1]  # newest first, each exactly once
    created = [j["created_at"] for p in pages for j in p["data"]]
    assert created == sorted(created, reverse=True)
    assert pages[0]["first_id"] == ids[-1]

    by_status = {s: [j["id"] for j in http.get("/finetune", params={"status": s, "limit": 100},
                                               headers=bed.auth("pager")).json()["data"]]
                 for s in ("running", "queued", "succeeded")}
    assert len(by_status["running"]) == 2 and len(by_status["queued"]) == 5 and by_status["succeeded"] == []
    assert sorted(by_status["running"] + by_status["queued"]) == sorted(ids)
    openai_view = http.get("/v1/fine_tuning/jobs", params={"limit": 100}, headers=bed.auth("pager")).json()
    assert [j["id"] for j in openai_view["data"]] == listed
    assert {j["object"] for j in openai_view["data"]} == {"fine_tuning.job"}

    for job_id in ids:
        http.post(f"/finetune/{job_id}/cancel", headers=bed.auth("pager"))
    wait_for(lambda: all(finished(http, bed, "pager", j) for j in ids))


def test_idempotency_key_returns_the_same_job(http, bed):
    spec = bed.spec(max_steps=3)
    first = submit(http, bed, "idem", spec, **{"Idempotency-Key": "retry-1"})
    again = submit(http, bed, "idem", spec, **{"Idempotency-Key": "retry-1"})
    assert again["id"] == first["id"]
    err = error_of(http.post("/finetune", json=bed.spec(max_steps=4),
                             headers={**bed.auth("idem"), "Idempotency-Key": "retry-1"}), 409, "idempotency_conflict")
    assert first["id"] in err["message"]
    other = submit(http, bed, "idem", spec, **{"Idempotency-Key": "retry-2"})
    assert other["id"] != first["id"]
    # The same key of another tenant is another job.
    theirs = submit(http, bed, "globex", spec, **{"Idempotency-Key": "retry-1"})
    assert theirs["id"] != first["id"]
    listed = [j["id"] for j in http.get("/finetune", params={"limit": 100}, headers=bed.auth("idem")).json()["data"]]
    assert sorted(listed) == sorted({first["id"], other["id"]})


# ---- tenant isolation ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def acme_assets(url, bed):
    """A finished job of acme with outputs, a running one, and an uploaded file of acme."""
    with httpx.Client(base_url=url, timeout=30) as http:
        done = submit(http, bed, "acme", bed.spec(max_steps=2))
        done = wait_for(lambda: finished(http, bed, "acme", done["id"]))
        write_outputs(done)
        up = http.post("/files", params={"filename": "acme.jsonl"}, headers=bed.auth("acme"),
                       content=b'{"text": "acme private data"}\n')
        assert up.status_code == 201, up.text
        running = submit(http, bed, "acme", bed.spec(max_steps=100_000))
        yield {"done": done["id"], "running": running["id"], "file": up.json()["id"]}
        http.post(f"/finetune/{running['id']}/cancel", headers=bed.auth("acme"))


ROUTES = [
    ("GET", "/finetune/{done}"),
    ("GET", "/finetune/{running}"),
    ("POST", "/finetune/{running}/cancel"),
    ("GET", "/finetune/{done}/events"),
    ("GET", "/finetune/{done}/checkpoints"),
    ("GET", "/finetune/{done}/outputs"),
    ("GET", "/finetune/{done}/outputs/final/config.json"),
    ("GET", "/v1/fine_tuning/jobs/{done}"),
    ("POST", "/v1/fine_tuning/jobs/{running}/cancel"),
    ("GET", "/v1/fine_tuning/jobs/{done}/events"),
    ("GET", "/v1/fine_tuning/jobs/{done}/checkpoints"),
    ("GET", "/finetune/{done}/outputs/final.tar"),
    ("GET", "/files/{file}"),
    ("GET", "/v1/files/{file}"),
    ("GET", "/v1/files/{file}/content"),
    ("DELETE", "/v1/files/{file}"),
    ("GET", "/files/{file}/content"),
    ("DELETE", "/files/{file}"),
]


@pytest.mark.parametrize("method, template", ROUTES)
def test_another_tenants_resources_are_404_on_every_route(http, bed, acme_assets, method, template):
    path = template.format(**acme_assets)
    mine = http.request(method, path, headers=bed.auth("acme")) if method == "GET" else None
    if mine is not None:
        assert mine.status_code == 200, mine.text  # the owner sees it
    theirs = http.request(method, path, headers=bed.auth("globex"))
    err = error_of(theirs, 404, "not_found")
    # Indistinguishable from an id that never existed.
    missing = http.request(method, path.replace(acme_assets["done"], "job-000000000000")
                           .replace(acme_assets["running"], "job-000000000000")
                           .replace(acme_assets["file"], "file-000000000000000000000000"),
                           headers=bed.auth("globex"))
    assert error_of(missing, 404, "not_found")["code"] == err["code"]
    # Nothing of acme's changed.
    assert http.get(f"/finetune/{acme_assets['running']}", headers=bed.auth("acme")).json()["status"] == "running"
    assert http.get(f"/files/{acme_assets['file']}", headers=bed.auth("acme")).status_code == 200


def test_another_tenants_event_stream_is_404(http, bed, acme_assets):
    r = http.get(f"/finetune/{acme_assets['running']}/events",
                 headers={**bed.auth("globex"), "Accept": "text/event-stream"})
    error_of(r, 404, "not_found")


def test_lists_show_only_the_callers_own(http, bed, acme_assets):
    jobs = http.get("/finetune", params={"limit": 100}, headers=bed.auth("globex")).json()["data"]
    assert not {acme_assets["done"], acme_assets["running"]} & {j["id"] for j in jobs}
    assert all(j["tenant"] == "globex" for j in jobs)
    files = http.get("/files", headers=bed.auth("globex")).json()["data"]
    assert acme_assets["file"] not in {f["id"] for f in files}
    queue = http.get("/queue", headers=bed.auth("globex")).json()
    assert all(e["id"] not in acme_assets.values() for e in queue["data"])
    # The node ledger shows acme's reservation to globex only as anonymous bytes.
    ledgers = {n["node_id"]: n["ledger"] for n in http.get("/nodes", headers=bed.auth("globex")).json()["data"]}
    entries = [r for ledger in ledgers.values() for r in ledger]
    assert entries and all(not r["mine"] and r["job_id"] is None for r in entries)
    own = [r for n in http.get("/nodes", headers=bed.auth("acme")).json()["data"] for r in n["ledger"]]
    assert any(r["mine"] and r["job_id"] == acme_assets["running"] for r in own)


def test_a_spec_cannot_reach_another_tenants_files_or_outputs(http, bed, acme_assets):
    acme_file = bed.settings.files_dir("acme") / f"{acme_assets['file']}.jsonl"
    for data_path, code in [(acme_assets["file"], "file_not_found"), (str(acme_file), "path_not_allowed")]:
        err = error_of(http.post("/finetune", json=bed.spec(data=data_path), headers=bed.auth("globex")), 422, code)
        assert err["field"] == "data.path"
    for output_dir in ("../acme/stolen", str(bed.settings.outputs_dir("acme") / "x")):
        err = error_of(http.post("/finetune", json={**bed.spec(), "output_dir": output_dir},
                                 headers=bed.auth("globex")), 422, "path_not_allowed")
        assert err["field"] == "output_dir"


# ---- paths ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def escape_links(bed):
    outside = bed.root / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "config.json").write_text("{}")
    (outside / "secret.jsonl").write_text('{"text": "node secret"}\n')
    link_model = bed.root / "models" / "escape"
    link_data = bed.root / "data" / "escape.jsonl"
    if not link_model.exists():
        link_model.symlink_to(outside)
        link_data.symlink_to(outside / "secret.jsonl")
    return outside


@pytest.mark.parametrize("section, key, value", [
    ("model", "path", "/etc"),
    ("model", "path", "../outside"),
    ("model", "path", "~/models/x"),
    ("model", "path", "escape"),
    ("model", "path", "{root}/outside"),
    ("model", "tokenizer_path", "/usr/share"),
    ("data", "path", "/etc/passwd"),
    ("data", "path", "../outside/secret.jsonl"),
    ("data", "path", "escape.jsonl"),
    ("data", "path", "{root}/outside/secret.jsonl"),
    ("data", "path", "sub/../../outside/secret.jsonl"),
    ("data", "eval_path", "/proc/self/environ"),
])
@pytest.mark.parametrize("route", ["/finetune", "/plan"])
def test_specs_pointing_outside_the_roots_are_refused(http, bed, escape_links, route, section, key, value):
    spec = bed.spec()
    spec[section] = {**spec[section], key: value.format(root=bed.root)}
    before = len(http.get("/finetune", params={"limit": 100}, headers=bed.auth("paths")).json()["data"])
    err = error_of(http.post(route, json=spec, headers=bed.auth("paths")), 422, "path_not_allowed")
    assert err["field"] == f"{section}.{key}"
    assert str(bed.root / "outside") not in err["message"]
    after = len(http.get("/finetune", params={"limit": 100}, headers=bed.auth("paths")).json()["data"])
    assert after == before


def test_names_that_do_not_exist_are_422_naming_the_field(http, bed):
    err = error_of(http.post("/finetune", json=bed.spec(model="no-such-model"), headers=bed.auth("paths")),
                   422, "path_not_found")
    assert err["field"] == "model.path"


# ---- events ------------------------------------------------------------------------------------------------


def test_sse_events_arrive_in_order_and_resume(http, bed):
    job = submit(http, bed, "streamer", {**bed.spec(max_steps=8), "checkpoint": {"every_steps": 4}})
    headers = {**bed.auth("streamer"), "Accept": "text/event-stream"}
    with http.stream("GET", f"/finetune/{job['id']}/events", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = read_sse(r)
    *typed, end = events
    assert end[1] == "end" and end[2]["status"] == "succeeded" and end[2]["last_seq"] == int(typed[-1][0])
    ids = [int(i) for i, _, _ in typed]
    assert ids == list(range(1, len(ids) + 1))
    assert {kind for _, kind, _ in typed} <= TYPED_EVENTS
    assert all(kind == data["type"] and int(i) == data["seq"] for i, kind, data in typed)
    assert typed[0][2]["data"]["to"] == "validating" and typed[-1][2]["data"]["to"] == "succeeded"
    assert [d["data"]["step"] for _, k, d in typed if k == "metrics"] == list(range(1, 9))
    assert [d["data"]["step"] for _, k, d in typed if k == "checkpoint"] == [4, 8]
    assert any(k == "memory" for _, k, _ in typed)

    # A client that reconnects with Last-Event-ID gets exactly the rest.
    with http.stream("GET", f"/finetune/{job['id']}/events", headers={**headers, "Last-Event-ID": "3"}) as r:
        resumed = read_sse(r)
    assert [e[0] for e in resumed[:-1]] == [str(i) for i in ids[3:]]
    page = http.get(f"/finetune/{job['id']}/events", params={"after": 3, "limit": 2},
                    headers=bed.auth("streamer")).json()
    assert [e["seq"] for e in page["data"]] == [4, 5] and page["has_more"] and page["last_seq"] == 5


def test_sse_stream_delivers_events_while_the_job_runs(http, bed):
    job = submit(http, bed, "streamer", bed.spec(max_steps=40))
    headers = {**bed.auth("streamer"), "Accept": "text/event-stream"}
    seen_running = False
    with http.stream("GET", f"/finetune/{job['id']}/events", headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"type":"metrics"' in line and not seen_running:
                # The job is still running while its metrics stream in.
                status = http.get(f"/finetune/{job['id']}", headers=bed.auth("streamer")).json()["status"]
                seen_running = status in ("running", "checkpointing")
            if line.startswith("event: end"):
                break
    assert seen_running


# ---- errors, files, plan, nodes, probes ----------------------------------------------------------------


def test_error_bodies_are_json_with_a_code(http, bed, url):
    assert error_of(http.get("/finetune"), 401, "unauthorized")
    error_of(http.get("/finetune/job-000000000000", headers=bed.auth("acme")), 404, "not_found")
    error_of(http.get("/no/such/route", headers=bed.auth("acme")), 404, "not_found")
    error_of(http.put("/finetune", headers=bed.auth("acme")), 405, "method_not_allowed")
    err = error_of(http.get("/finetune", params={"limit": 1000}, headers=bed.auth("acme")), 422, "validation_error")
    assert err["field"] == "limit"
    err = error_of(http.post("/finetune", json={**bed.spec(), "training": {"max_steps": 3, "learning_rate": 1}},
                             headers=bed.auth("acme")), 422, "invalid_spec")
    assert err["field"] == "training.learning_rate" and "training.lr" in err["message"]
    err = error_of(http.post("/finetune", json=bed.spec(model="1TiB"), headers=bed.auth("acme")), 422, "rejected")
    assert {n["node_id"] for n in err["details"]["nodes"]} == {"a", "b"}
    big = json.dumps({**bed.spec(), "name": "x" * 70_000})
    error_of(http.post("/finetune", content=big, headers={**bed.auth("acme"), "Content-Type": "application/json"}),
             413, "payload_too_large")

    def chunked():
        for _ in range(100):
            yield b" " * 1024

    error_of(http.post("/plan", content=chunked(), headers={**bed.auth("acme"), "Content-Type": "application/json"}),
             413, "payload_too_large")


def test_quota_exceeded_is_429(tmp_path):
    bed = make_testbed(tmp_path, quotas={"default": {"max_concurrent_jobs": 1, "max_queued_jobs": 1}})
    try:
        with running_server(create_app(bed.client, bed.settings)) as url, httpx.Client(base_url=url) as http:
            long = bed.spec(max_steps=100_000)
            submit(http, bed, "acme", long)  # runs
            submit(http, bed, "acme", long)  # waits
            err = error_of(http.post("/finetune", json=long, headers=bed.auth("acme")), 429, "quota_exceeded")
            assert "quota" in err["message"]
            submit(http, bed, "globex", long)  # quotas are per tenant
    finally:
        bed.close()


def test_files_upload_list_use_delete(http, bed):
    lines = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
             for i in range(5)]
    body = "".join(json.dumps(x) + "\n" for x in lines).encode()
    r = http.post("/files", params={"filename": "../../chat.jsonl"}, content=body,
                  headers={**bed.auth("files"), "Content-Type": "application/x-ndjson"})
    assert r.status_code == 201, r.text
    f = r.json()
    assert r.headers["location"] == f"/files/{f['id']}"
    assert (f["filename"], f["format"], f["num_examples"], f["bytes"]) == ("chat.jsonl", "messages", 5, len(body))
    stored = bed.settings.files_dir("files") / f"{f['id']}.jsonl"
    assert stored.read_bytes() == body

    assert f["id"] in [x["id"] for x in http.get("/files", headers=bed.auth("files")).json()["data"]]
    assert http.get(f"/files/{f['id']}", headers=bed.auth("files")).json()["sha256"] == f["sha256"]
    assert http.get(f"/files/{f['id']}/content", headers=bed.auth("files")).content == body

    job = submit(http, bed, "files", bed.spec(data=f["id"], max_steps=2))
    assert job["spec"]["data"]["path"] == str(stored)
    if job["node_id"]:
        bed.agent(job["node_id"]).hold(job["id"])  # a job that has not ended reads the file (again on resume)
    err = error_of(http.delete(f"/files/{f['id']}", headers=bed.auth("files")), 409, "file_in_use")
    assert job["id"] in err["message"] and stored.exists()
    if job["node_id"]:
        bed.agent(job["node_id"]).hold(job["id"], False)
    wait_for(lambda: finished(http, bed, "files", job["id"]))

    r = http.delete(f"/files/{f['id']}", headers=bed.auth("files"))
    assert r.status_code == 200 and r.json()["deleted"] is True
    error_of(http.get(f"/files/{f['id']}", headers=bed.auth("files")), 404, "not_found")
    assert not stored.exists()
    err = error_of(http.post("/finetune", json=bed.spec(data=f["id"]), headers=bed.auth("files")),
                   422, "file_not_found")
    assert err["field"] == "data.path"


@pytest.mark.parametrize("content, needle", [
    (b'{"text": "ok"}\n{"text": \n', "bad.jsonl:2"),
    (b'{"prompt": "?", "completion": "!"}\n', "cannot tell the format"),
    (b'["not", "an", "object"]\n', "JSON object"),
    (b"\xff\xfe garbage\n", "bad.jsonl"),
    (b"", "empty"),
])
def test_uploads_that_are_not_a_known_jsonl_format_are_refused(http, bed, content, needle):
    before = sorted(p.name for p in bed.settings.files_dir("files").glob("*")) \
        if bed.settings.files_dir("files").exists() else []
    r = http.post("/files", params={"filename": "bad.jsonl"}, content=content, headers=bed.auth("files"))
    err = error_of(r, 422, "invalid_file")
    assert needle in err["message"]
    assert str(bed.root) not in err["message"]  # the server's paths stay private
    after = sorted(p.name for p in bed.settings.files_dir("files").glob("*"))
    assert after == before


def test_form_uploads_and_oversized_uploads_are_refused(http, bed):
    r = http.post("/files", files={"file": ("a.jsonl", b'{"text": "x"}\n')}, headers=bed.auth("files"))
    error_of(r, 415, "unsupported_media_type")
    line = b'{"text": "' + b"x" * 1000 + b'"}\n'
    error_of(http.post("/files", content=line * 300, headers=bed.auth("files")), 413, "payload_too_large")


def test_plan_is_a_dry_run(http, bed):
    before = http.get("/finetune", params={"limit": 100}, headers=bed.auth("paths")).json()["data"]
    plan = http.post("/plan", json=bed.spec(model="8GiB"), headers=bed.auth("paths")).json()
    assert plan["decision"] == "place" and plan["node_id"] in ("a", "b")
    assert plan["plan"]["host_bytes"] == 8 * 2**30
    assert {n["node_id"]: n["fits"] for n in plan["nodes"]} == {"a": True, "b": True}
    reject = http.post("/plan", json=bed.spec(model="1TiB"), headers=bed.auth("paths")).json()
    assert reject["decision"] == "reject" and reject["node_id"] is None and "1.0 TiB" in reject["reason"]
    after = http.get("/finetune", params={"limit": 100}, headers=bed.auth("paths")).json()["data"]
    assert after == before


def test_nodes_probes_and_metrics(http, bed):
    nodes = {n["node_id"]: n for n in http.get("/nodes", headers=bed.auth("acme")).json()["data"]}
    assert nodes["a"]["ram_bytes"] == 16 * 2**30 and nodes["b"]["ram_bytes"] == 64 * 2**30
    for n in nodes.values():
        assert n["free_bytes"] == n["ram_bytes"] - n["reserved_bytes"]
        assert n["reserved_bytes"] == sum(r["host_bytes"] for r in n["ledger"])
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready"}
    http.get("/scanner/probe/1")
    text = http.get("/metrics", headers=bed.auth("acme")).text
    assert 'horizon_api_requests_total{method="GET",route="/nodes",status="200"}' in text
    assert 'horizon_api_requests_total{method="GET",route="/finetune/{job_id}",status="200"}' in text
    assert 'horizon_api_requests_total{method="GET",route="unmatched",status="404"}' in text
    assert "/scanner/probe" not in text  # unmatched paths share one label
    assert 'horizon_node_ram_bytes{node="a"} 1.7179869184e+10' in text
    assert "horizon_coordinator_up 1.0" in text


def test_event_stream_stops_polling_when_the_client_goes_away(tmp_path):
    bed = make_testbed(tmp_path)
    calls = {"events": 0}

    class Counting:
        def __getattr__(self, name):
            method = getattr(bed.client, name)
            if name != "events":
                return method

            def counted(*args, **kwargs):
                calls["events"] += 1
                return method(*args, **kwargs)
            return counted

    try:
        with running_server(create_app(Counting(), bed.settings)) as url, httpx.Client(base_url=url) as http:
            job = submit(http, bed, "acme", bed.spec(max_steps=10))
            bed.agent(job["node_id"]).hold(job["id"])  # no more events: the stream only polls
            headers = {**bed.auth("acme"), "Accept": "text/event-stream"}
            with http.stream("GET", f"/finetune/{job['id']}/events", headers=headers) as r:
                lines = r.iter_lines()
                while '"to":"running"' not in next(lines):
                    pass
            # the polls stop once the server notices the closed connection, however long a busy machine takes
            # to: the count must come to rest, for longer than the feed's longest pause between two polls
            quiet_s, deadline = 2.5 * FEED_IDLE_POLL_S, time.monotonic() + 60
            settled, since = calls["events"], time.monotonic()
            while time.monotonic() - since < quiet_s:
                assert time.monotonic() < deadline, "the stream kept polling for a client that left"
                time.sleep(0.05)
                if calls["events"] != settled:
                    settled, since = calls["events"], time.monotonic()
            assert settled > 0
    finally:
        bed.close()
