"""The app in-process (Starlette's TestClient): auth, the one error mapping, body limits, OpenAPI, dashboard."""

import re

import pytest
from fastapi.testclient import TestClient

from api.app import STATIC_DIR, create_app
from api.testing import make_testbed
from horizon_ray.cluster.errors import (
    CoordinatorUnavailable,
    IdempotencyConflict,
    InvalidRequest,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    JobRejected,
    QuotaExceeded,
)


@pytest.fixture
def bed(tmp_path):
    bed = make_testbed(tmp_path, max_body_bytes=4096, max_upload_bytes=8192)
    yield bed
    bed.close()


@pytest.fixture
def http(bed):
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as c:
        yield c


def assert_error(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in r.text
    return body["error"]


def test_open_routes_need_no_key(http, bed):
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready"}
    assert http.get("/").status_code == 200
    # /metrics counts every tenant's jobs: a key's holders only, unless the operator opens it
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers=bed.auth("acme")).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic a2V5"},
                                     {"Authorization": "Bearer "}])
def test_every_other_route_needs_a_valid_key(http, headers):
    for method, path in [("GET", "/finetune"), ("POST", "/finetune"), ("GET", "/finetune/job-1"),
                         ("POST", "/finetune/job-1/cancel"), ("GET", "/finetune/job-1/events"),
                         ("GET", "/finetune/job-1/checkpoints"), ("GET", "/finetune/job-1/outputs"),
                         ("GET", "/finetune/job-1/outputs/a"), ("GET", "/v1/fine_tuning/jobs"), ("GET", "/v1/files"),
                         ("POST", "/v1/files"), ("GET", "/v1/models"), ("GET", "/v1/models/ft:a:b::job-1"),
                         ("POST", "/v1/fine_tuning/jobs"),
                         ("POST", "/plan"), ("GET", "/nodes"), ("GET", "/queue"), ("GET", "/files"),
                         ("POST", "/files"), ("GET", "/files/file-1"), ("DELETE", "/files/file-1")]:
        r = http.request(method, path, headers=headers, json={} if method == "POST" else None)
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Bearer")


class Raising:
    """A client whose every call raises `exc`."""

    def __init__(self, exc):
        self.exc = exc

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise self.exc
        return fail


@pytest.mark.parametrize("exc, status, code", [
    (InvalidSpec("training.lr is -1.0; set a positive learning rate"), 422, "invalid_spec"),
    (InvalidRequest("limit is 0"), 422, "invalid_request"),
    (JobRejected("no node can ever hold this job", nodes=[]), 422, "rejected"),
    (QuotaExceeded("too many jobs waiting", limit="max_queued_jobs"), 429, "quota_exceeded"),
    (JobNotFound("no job 'x'"), 404, "not_found"),
    (InvalidTransition("job already succeeded"), 409, "invalid_transition"),
    (IdempotencyConflict("key used with another spec"), 409, "idempotency_conflict"),
    (CoordinatorUnavailable("coordinator did not answer"), 503, "unavailable"),
])
def test_domain_errors_map_to_one_status_each(bed, exc, status, code):
    app = create_app(Raising(exc), bed.settings)
    with TestClient(app, raise_server_exceptions=False) as http:
        err = assert_error(http.get("/finetune/job-1", headers=bed.auth("acme")), status, code)
    if isinstance(exc, InvalidSpec):
        assert err["field"] == "training.lr"


def test_unexpected_errors_are_a_500_without_a_traceback(bed):
    app = create_app(Raising(RuntimeError("secret internal detail /etc/shadow")), bed.settings)
    with TestClient(app, raise_server_exceptions=False) as http:
        r = http.get("/finetune", headers=bed.auth("acme"))
        err = assert_error(r, 500, "internal_error")
        assert "secret" not in r.text and "shadow" not in r.text
        assert err["message"].startswith("internal server error")
        # The readiness probe turns a dead coordinator into a 503, not a 500.
        assert_error(http.get("/readyz"), 503, "unavailable")


def test_validation_errors_name_the_field(http, bed):
    err = assert_error(http.get("/finetune?limit=0", headers=bed.auth("acme")), 422, "validation_error")
    assert err["field"] == "limit"
    err = assert_error(http.get("/finetune?status=bogus", headers=bed.auth("acme")), 422, "validation_error")
    assert err["field"] == "status"
    err = assert_error(http.post("/finetune", content=b"[1, 2]", headers={**bed.auth("acme"),
                                                                         "Content-Type": "application/json"}),
                       422, "validation_error")
    assert err["field"] == "body" or err["field"].startswith("body")
    err = assert_error(http.post("/finetune", content=b"{not json", headers={**bed.auth("acme"),
                                                                            "Content-Type": "application/json"}),
                       422, "validation_error")
    assert err["field"] == "body" and "JSON" in err["message"]
    err = assert_error(http.post("/finetune", json={**bed.spec(), "trainer": {}}, headers=bed.auth("acme")),
                       422, "invalid_spec")
    assert err["field"] == "trainer"
    err = assert_error(http.post("/finetune", json=bed.spec(lr=-1), headers=bed.auth("acme")), 422, "invalid_spec")
    assert err["field"] == "training.lr"


def test_unknown_routes_and_methods_are_json(http, bed):
    assert_error(http.get("/nope", headers=bed.auth("acme")), 404, "not_found")
    assert_error(http.delete("/finetune", headers=bed.auth("acme")), 405, "method_not_allowed")


def test_oversized_bodies_are_refused_413(http, bed):
    big = b'{"x": "' + b"a" * 5000 + b'"}'
    headers = {**bed.auth("acme"), "Content-Type": "application/json"}
    assert_error(http.post("/finetune", content=big, headers=headers), 413, "payload_too_large")

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(10):
            yield b"a" * 1000

    assert_error(http.post("/plan", content=chunks(), headers=headers), 413, "payload_too_large")
    # Uploads have their own, larger limit, and the refused upload leaves nothing behind.
    line = b'{"text": "' + b"x" * 100 + b'"}\n'
    assert http.post("/files", content=line * 60, headers=bed.auth("acme")).status_code == 201
    assert_error(http.post("/files", content=line * 100, headers=bed.auth("acme")), 413, "payload_too_large")

    def upload_chunks():
        for _ in range(100):
            yield line

    assert_error(http.post("/files", content=upload_chunks(), headers=bed.auth("acme")), 413, "payload_too_large")
    leftovers = [p.name for p in bed.settings.files_dir("acme").iterdir()]
    assert len(leftovers) == 2 and not any(n.endswith(".part") for n in leftovers)


def test_openapi_documents_the_job_spec_strictly(http):
    schema = http.get("/openapi.json").json()
    comps = schema["components"]["schemas"]
    assert comps["JobSpec"]["additionalProperties"] is False
    assert comps["TrainingSpec"]["properties"]["lr"]["type"] == "number"
    body = schema["paths"]["/finetune"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/JobSpec"}
    assert "/v1/fine_tuning/jobs/{job_id}/cancel" in schema["paths"]
    assert "security" not in schema["paths"]["/healthz"]["get"]
    assert schema["paths"]["/nodes"]["get"]["security"] == [{"bearer": []}]


def test_dashboard_is_self_contained(http):
    r = http.get("/")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert 'src="/static/app.js"' in r.text
    for name in ("index.html", "app.js", "style.css", "favicon.svg"):
        text = (STATIC_DIR / name).read_text()
        assert not re.search(r"https?://", text.replace("http://www.w3.org/2000/svg", "")), name
        assert http.get(f"/static/{name}").status_code == 200


def test_a_diverged_loss_does_not_break_the_job_page(bed):
    import time

    from horizon_ray.cluster.messages import EventType, JobEvent, JobRecord, JobStatus, Progress

    nan = float("nan")
    record = JobRecord(id="job-000000000001", tenant="acme", name=None, status=JobStatus.RUNNING, priority=0,
                       created_at=time.time(), spec={}, metrics={"loss": nan, "grad_norm": float("inf")},
                       progress=Progress(step=3, total_steps=10, tokens_per_s=nan, eta_s=float("inf")))

    class Diverged:
        def get(self, tenant, job_id):
            return record

        def events(self, tenant, job_id, after_seq=0, limit=None):
            return [JobEvent(1, job_id, time.time(), EventType.METRICS, {"step": 3, "loss": nan})][:limit]

    with TestClient(create_app(Diverged(), bed.settings), raise_server_exceptions=False) as http:
        job = http.get("/finetune/job-000000000001", headers=bed.auth("acme"))
        assert job.status_code == 200, job.text
        assert job.json()["metrics"] == {"loss": "nan", "grad_norm": "inf"}
        assert job.json()["progress"]["tokens_per_s"] is None and job.json()["progress"]["eta_s"] is None
        events = http.get("/finetune/job-000000000001/events", headers=bed.auth("acme"))
        assert events.status_code == 200 and events.json()["data"][0]["data"]["loss"] == "nan"


def test_nodes_show_a_tenant_its_own_reservations_with_one_coordinator_call(http, bed):
    mine = http.post("/finetune", json=bed.spec(), headers=bed.auth("acme")).json()
    theirs = http.post("/finetune", json=bed.spec(), headers=bed.auth("globex")).json()
    assert mine["status"] == theirs["status"] == "running"

    class Counting:
        """The testbed's client, recording which methods the route calls."""

        def __init__(self, client):
            self.client, self.calls = client, []

        def __getattr__(self, name):
            self.calls.append(name)
            return getattr(self.client, name)

    counting = Counting(bed.client)
    with TestClient(create_app(counting, bed.settings), raise_server_exceptions=False) as c:
        nodes = c.get("/nodes", headers=bed.auth("acme")).json()["data"]
    assert counting.calls == ["nodes"]  # the reservation names its tenant: no call per job
    ledger = [r for n in nodes for r in n["ledger"]]
    assert sorted((r["mine"], r["job_id"]) for r in ledger) == [(False, None), (True, mine["id"])]


# ---- settings ----------------------------------------------------------------------------------------------


def test_settings_come_from_one_table_and_share_the_service_root(tmp_path):
    from api.settings import SETTINGS, ApiSettings

    env = {"HORIZON_RAY_HOME": str(tmp_path / "home"), "HORIZON_API_KEYS": "k=me"}
    s = ApiSettings.from_env(env)
    # the coordinator's default jobs root under `serve`: $HORIZON_RAY_HOME/service/jobs
    assert s.jobs_root == tmp_path / "home" / "service" / "jobs"
    assert s.uploads_dir == tmp_path / "home" / "service" / "uploads"
    assert ApiSettings.from_env(env, root=tmp_path / "r").jobs_root == tmp_path / "r" / "jobs"
    assert ApiSettings.from_env({**env, "HORIZON_JOBS_ROOT": str(tmp_path / "j")}, root=tmp_path).jobs_root == \
        tmp_path / "j"
    names = [x.env for x in SETTINGS]
    assert len(set(names)) == len(names) and all(n.startswith("HORIZON_") for n in names)
    import api.settings as module

    # every variable a field reads is in the table, and nothing else but the two other modules read
    read = {f.validation_alias for f in ApiSettings.model_fields.values() if f.validation_alias}
    assert read | {module.ENV_HOME, module.ENV_ENGINE_ENV} == set(names)
    assert {v for k, v in vars(module).items() if k.startswith("ENV_")} <= set(names)


@pytest.mark.parametrize("env, words", [
    ({"HORIZON_MODEL_CATALOGUE": "m=/elsewhere/m", "HORIZON_MODEL_ROOTS": "/models"},
     "HORIZON_MODEL_CATALOGUE: m=/elsewhere/m lies under no model root (/models); add its parent directory to "
     "HORIZON_MODEL_ROOTS"),
    ({"HORIZON_API_MAX_UPLOAD_BYTES": "1GiB"}, "HORIZON_API_MAX_UPLOAD_BYTES='1GiB' is not a number of bytes"),
    ({"HORIZON_API_KEYS_FILE": "/no/such/keys.yaml"}, "HORIZON_API_KEYS_FILE=/no/such/keys.yaml: cannot read it"),
])
def test_a_bad_setting_is_refused_naming_the_variable(env, words):
    from api.settings import ApiSettings
    from horizon_ray.errors import BadInput

    with pytest.raises(BadInput) as info:
        ApiSettings.from_env(env)
    assert words in info.value.message


def test_a_spec_naming_a_model_on_a_server_without_model_roots_is_told_the_variable(tmp_path):
    bed = make_testbed(tmp_path, model_roots=[])
    try:
        with TestClient(create_app(bed.client, bed.settings)) as http:
            r = http.post("/finetune", json=bed.spec(), headers=bed.auth("acme"))
        err = assert_error(r, 422, "path_not_allowed")
        assert "HORIZON_MODEL_ROOTS is not set" in err["message"] and err["field"] == "model.path"
    finally:
        bed.close()


def test_without_auth_every_request_is_the_default_tenant(tmp_path):
    bed = make_testbed(tmp_path, api_keys={}, insecure_no_auth=True)
    try:
        with TestClient(create_app(bed.client, bed.settings)) as http:
            job = http.post("/finetune", json=bed.spec()).json()
            assert job["tenant"] == "default"
            assert http.get(f"/finetune/{job['id']}", headers={"Authorization": "Bearer anything"}).status_code == 200
    finally:
        bed.close()


def test_an_upload_counts_tokens_with_the_tokenizer_it_names(bed, http):
    from horizon_ray.data import build_demo_tokenizer

    build_demo_tokenizer(bed.root / "models" / "1GiB")
    body = b'{"text": "hello there"}\n{"text": "a longer line of text than that"}\n'
    r = http.post("/files?filename=t.jsonl&tokenizer=1GiB", content=body, headers={
        **bed.auth("acme"), "Content-Type": "application/x-ndjson"})
    assert r.status_code == 201, r.text
    stats = r.json()["stats"]
    # text trains every token but each example's first (nothing precedes it to predict it from)
    assert stats["examples"] == 2 and stats["trained_tokens"] == stats["tokens"] - 2 > 0
    assert stats["tokenizer"] == "1GiB"
    assert http.get(f"/files/{r.json()['id']}", headers=bed.auth("acme")).json()["stats"] == stats
