"""The API's edge: every string a client sends is checked where it comes in (422 naming the field), nothing
stored can break a later read, nothing internal goes out, /docs loads nothing from elsewhere, and uploads
never go through a symbolic link. In-process (Starlette's TestClient) over the testbed's coordinator."""

from __future__ import annotations

import json
import os
import time
import types
import typing
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from api.app import create_app
from api.testing import make_testbed
from horizon_ray.cluster.errors import CoordinatorUnavailable
from horizon_ray.jobspec import JobSpec
from horizon_ray.strings import problem

EXAMPLES = int(os.environ.get("HORIZON_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    bed = make_testbed(tmp_path_factory.mktemp("edge"), max_body_bytes=1 << 20)
    yield bed
    bed.close()


@pytest.fixture(scope="module")
def http(bed):
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as c:
        yield c


def post_json(http, url, body, headers):
    # json.dumps escapes a lone surrogate as \\udXXX: the body is valid JSON that decodes to it
    return http.post(url, content=json.dumps(body).encode(), headers={**headers, "Content-Type": "application/json"})


def assert_422_naming(r, field):
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return err


def reads_still_work(http, bed, tenant):
    """Every job of the tenant still lists, shows and streams its events as JSON."""
    r = http.get("/finetune", params={"limit": 100}, headers=bed.auth(tenant))
    assert r.status_code == 200, r.text
    for job in r.json()["data"]:
        assert http.get(f"/finetune/{job['id']}", headers=bed.auth(tenant)).status_code == 200
        assert http.get(f"/finetune/{job['id']}/events", headers=bed.auth(tenant)).status_code == 200


# ---- every string field of the spec ----------------------------------------------------------------------


def string_fields(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted field, is a list of strings) for every field of the spec whose values are strings."""
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        args = [a for a in typing.get_args(ann) if a is not type(None)] if union else [ann]
        section = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if section is not None:
            out += string_fields(section, f"{prefix}{name}.")
            continue
        flat = [typing.get_origin(a) or a for a in args]
        if list in flat:
            inner = typing.get_args(args[flat.index(list)])[0]
            if _stringy(inner):
                out.append((f"{prefix}{name}", True))
        elif any(_stringy(a) for a in args):
            out.append((f"{prefix}{name}", False))
    return out


def _stringy(tp) -> bool:
    tp = typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp
    if tp is str:
        return True
    if typing.get_origin(tp) is typing.Literal:
        return all(isinstance(v, str) for v in typing.get_args(tp))
    return any(_stringy(a) for a in typing.get_args(tp))


FIELDS = string_fields()


def test_the_fuzz_covers_every_string_field_of_the_spec():
    names = {f for f, _ in FIELDS}
    assert {"model.path", "model.tokenizer_path", "data.path", "data.eval_path", "data.format", "output_dir",
            "name", "method", "engine.device", "lora.modules_to_save", "lora.targets"} <= names, names


# Strings that break things: lone surrogates, NUL and other controls, long components, long paths, and text.
HOSTILE = st.one_of(
    st.text(st.characters(codec=None, categories=["Cs", "Cc"]), min_size=1, max_size=3).flatmap(
        lambda bad: st.tuples(st.text(max_size=8), st.text(max_size=8)).map(lambda ab: ab[0] + bad + ab[1])),
    st.integers(256, 400).map(lambda n: "runs/" + "x" * n),
    st.integers(4097, 4500).map(lambda n: "/".join(["d" * 200] * (n // 201 + 1))),
    st.text(st.characters(codec=None), max_size=40),
)


def spec_with(bed, field: str, is_list: bool, value: str) -> dict:
    spec = bed.spec()
    *sections, key = field.split(".")
    node = spec
    for section in sections:
        node = node.setdefault(section, {})
    if sections[:1] == ["lora"]:
        spec["method"] = "lora"
    if sections == ["integrations", "wandb"]:
        node["project"] = "p"  # the section's one required field (overwritten when it is the field tested)
    node[key] = [value] if is_list else value
    return spec


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(where=st.sampled_from(FIELDS), value=HOSTILE, route=st.sampled_from(["/finetune", "/plan"]))
def test_every_string_field_of_the_spec_is_checked_at_the_edge(http, bed, where, value, route):
    field, is_list = where
    r = post_json(http, route, spec_with(bed, field, is_list, value), bed.auth("acme"))
    assert r.status_code < 500, r.text
    seen = json.loads(json.dumps(value))  # what the server decodes: an escaped surrogate pair is one character
    bad = problem(seen, max_bytes=4096, path=True) if "path" in field or field == "output_dir" \
        else problem(seen)
    if bad is not None and "bytes long" not in bad and "component" not in bad:
        # a surrogate or a control character: refused at once, naming the field (a list: its element)
        assert_422_naming(r, f"{field}[0]" if is_list else field)
    if r.status_code == 422:
        assert r.json()["error"]["field"], r.text
    reads_still_work(http, bed, "acme")


@pytest.mark.parametrize("field,value", [
    ("name", "job \ud800 name"),  # created and ran, then the tenant's job list answered 500
    ("output_dir", "runs/\udfff"),  # a 500 from the path code
    ("output_dir", "r" * 4400),  # ENAMETOOLONG: a 500
    ("output_dir", "runs/" + "c" * 300),  # a 300-byte component was accepted; the job failed at its start
    ("output_dir", "/".join(["d" * 250] * 16)),  # each component fine, the whole path over PATH_MAX
    ("data.path", "demo\x00.jsonl"),
    ("model.path", "1GiB\n"),
    ("name", "line one\nforged line"),
    ("name", "report-\u202egnp.exe"),  # a bidi override: shown as "report-exe.png"
    ("name", "\ufeffacme"),  # a byte-order mark
    ("data.path", "demo\u200b.jsonl"),  # a zero-width space
    ("name", "one\u2028two"),  # a line separator
])
def test_the_probes_findings_are_422_naming_the_field(http, bed, field, value):
    r = post_json(http, "/finetune", spec_with(bed, field, False, value), bed.auth("globex"))
    err = assert_422_naming(r, field)
    assert "Traceback" not in r.text and err["message"].startswith(field)
    reads_still_work(http, bed, "globex")


def test_a_record_stored_before_the_checks_still_reads(bed):
    """A job whose name holds a lone surrogate (stored before the edge refused them) does not break the list."""
    client = bed.client
    job = client.submit("acme", bed.spec())
    stored = client.coordinator.store.get_job(job.id)
    stored.name = "old \ud800 name"
    stored.spec = {**stored.spec, "name": "old \ud800 name"}
    client.coordinator.store.put_job(stored)
    with TestClient(create_app(client, bed.settings), raise_server_exceptions=False) as http:
        r = http.get("/finetune", params={"limit": 100}, headers=bed.auth("acme"))
        assert r.status_code == 200, r.text
        assert any(j["name"] == "old \ud800 name" for j in r.json()["data"])  # the JSON escape round-trips
        assert http.get(f"/finetune/{job.id}", headers=bed.auth("acme")).status_code == 200


# ---- path and query parameters, headers ------------------------------------------------------------------


PARAM_TEXT = st.text(st.characters(codec=None, exclude_categories=["Cs"]), min_size=1, max_size=80)


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(value=PARAM_TEXT, where=st.sampled_from(["job_id", "file_id", "content", "output", "after"]))
def test_path_and_query_parameters_are_checked(http, bed, value, where):
    auth = bed.auth("acme")
    enc = quote(value, safe="")
    r = {
        "job_id": lambda: http.get(f"/finetune/{enc}", headers=auth),
        "file_id": lambda: http.get(f"/files/{enc}", headers=auth),
        "content": lambda: http.get(f"/files/{enc}/content", headers=auth),
        "output": lambda: http.get(f"/finetune/job-000000000000/outputs/{quote(value, safe='/')}", headers=auth),
        "after": lambda: http.get("/finetune", params={"after": value}, headers=auth),
    }[where]()
    assert r.status_code < 500, r.text
    if problem(value) is not None and "bytes long" not in problem(value):
        field = {"content": "file_id", "output": "path"}.get(where, where)
        assert_422_naming(r, field)
    assert value not in r.text or problem(value) is None  # a refused value is never echoed raw


# ASCII with its control characters, but none a header cannot carry at all (CR, LF, NUL)
HEADER_TEXT = st.text(st.characters(max_codepoint=0x7F, exclude_characters="\r\n\x00"), min_size=1,
                      max_size=60).filter(lambda v: v == v.strip())


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(value=HEADER_TEXT)
def test_stored_and_echoed_headers_are_checked(http, bed, value):
    auth = bed.auth("acme")
    r = post_json(http, "/finetune", bed.spec(), {**auth, "Idempotency-Key": value})
    assert r.status_code < 500, r.text
    if problem(value) is not None:
        assert_422_naming(r, "Idempotency-Key")
    else:
        assert r.status_code in (200, 201, 409), r.text
    s = http.get("/finetune/job-000000000000/events", headers={**auth, "Accept": "text/event-stream",
                                                              "Last-Event-ID": value})
    assert s.status_code in (404, 422), s.text  # checked (422) before the job is looked up (404)
    if not (value.isascii() and value.isdecimal() and len(value) <= 19):
        assert_422_naming(s, "Last-Event-ID")
    reads_still_work(http, bed, "acme")


def test_uploaded_file_names_are_checked(http, bed):
    body = json.dumps({"text": "hello"}).encode() + b"\n"
    for bad in ("a\x00b.jsonl", "tab\there.jsonl", "x" * 256 + ".jsonl", "\x85.jsonl"):
        r = http.post("/files", params={"filename": bad}, content=body, headers=bed.auth("acme"))
        assert_422_naming(r, "filename")
    ok = http.post("/files", params={"filename": "ünïcode name.jsonl"}, content=body, headers=bed.auth("acme"))
    assert ok.status_code == 201, ok.text


# ---- nothing internal in responses ---------------------------------------------------------------------


def test_503_bodies_name_nothing_internal(bed):
    inside = ("coordinator did not answer list: ActorDiedError: The actor died unexpectedly. actor_id="
              "9f2c1a5e0b3d4f6a8c7e01000000, pid=48213, ip=10.42.0.17, namespace=horizon-ray, "
              "name=horizon-coordinator")

    class Down:
        def list(self, *args, **kwargs):
            raise CoordinatorUnavailable(inside)

    with TestClient(create_app(Down(), bed.settings), raise_server_exceptions=False) as http:
        r = http.get("/finetune", headers=bed.auth("acme"))
    assert r.status_code == 503 and r.headers["retry-after"].isdigit()
    text = r.text
    for secret in ("9f2c1a5e", "48213", "10.42.0.17", "horizon-ray", "horizon-coordinator", "Actor"):
        assert secret not in text, text
    assert r.json()["error"] == {"code": "unavailable",
                                 "message": "the coordinator is not answering; retry in a few seconds"}


def test_sse_end_event_never_echoes_an_absurd_last_event_id(bed):
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
        job = http.post("/finetune", json=bed.spec(max_steps=3), headers=bed.auth("acme")).json()
        deadline = time.monotonic() + 30
        while http.get(f"/finetune/{job['id']}", headers=bed.auth("acme")).json()["status"] != "succeeded":
            assert time.monotonic() < deadline, "the job did not finish"
        real = http.get(f"/finetune/{job['id']}/events", params={"limit": 1000},
                        headers=bed.auth("acme")).json()["data"][-1]["seq"]
        absurd = "9" * 19
        r = http.get(f"/finetune/{job['id']}/events",
                     headers={**bed.auth("acme"), "Accept": "text/event-stream", "Last-Event-ID": absurd})
        assert r.status_code == 200
        end = [line for line in r.text.splitlines() if line.startswith("data: ")][-1]
        assert json.loads(end[6:]) == {"job_id": job["id"], "status": "succeeded", "last_seq": real}
        assert absurd not in r.text
        r = http.get(f"/finetune/{job['id']}/events",
                     headers={**bed.auth("acme"), "Accept": "text/event-stream", "Last-Event-ID": "9" * 29})
        assert_422_naming(r, "Last-Event-ID")


def test_docs_are_off_by_default_and_vendored_with_a_csp_when_on(bed, tmp_path):
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert http.get(path).status_code == 404, path
        assert http.get("/openapi.json").status_code == 200
    on = make_testbed(tmp_path / "docs", docs=True)
    try:
        with TestClient(create_app(on.client, on.settings), raise_server_exceptions=False) as http:
            page = http.get("/docs")
            assert page.status_code == 200
            csp = page.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "default-src 'self'" in csp
            assert "http://" not in page.text and "https://" not in page.text and "<script>" not in page.text
            for src in ("/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/docs/init.js"):
                assert src in page.text and http.get(src).status_code == 200, src
            assert "/openapi.json" in http.get("/docs/init.js").text
            assert http.get("/redoc").status_code == 404
    finally:
        on.close()


# ---- uploads never follow a symbolic link ----------------------------------------------------------------


def upload(http, bed, tenant, text="hello"):
    r = http.post("/files", params={"filename": "t.jsonl"}, content=json.dumps({"text": text}).encode() + b"\n",
                  headers=bed.auth(tenant))
    assert r.status_code == 201, r.text
    return r.json()


def test_a_link_planted_under_an_uploads_name_is_no_file(http, bed, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"text": "not yours"}) + "\n")
    mine = upload(http, bed, "acme")
    files = bed.settings.files_dir("acme")
    planted = "file-" + "ab" * 12
    os.symlink(secret, files / f"{planted}.jsonl")
    (files / f"{planted}.json").write_text(json.dumps({**mine, "id": planted}))
    auth = bed.auth("acme")
    assert http.get(f"/files/{planted}/content", headers=auth).status_code == 404
    assert planted not in [f["id"] for f in http.get("/files", headers=auth).json()["data"]]
    r = http.post("/finetune", json={**bed.spec(), "data": {"path": planted}}, headers=auth)
    assert_422_naming(r, "data.path")
    # metadata through a link is none either
    linked_meta = "file-" + "cd" * 12
    os.symlink(files / f"{mine['id']}.json", files / f"{linked_meta}.json")
    os.link(files / f"{mine['id']}.jsonl", files / f"{linked_meta}.jsonl")  # a hard link is a plain file
    assert http.get(f"/files/{linked_meta}", headers=auth).status_code == 404
    assert http.get(f"/files/{mine['id']}/content", headers=auth).text == '{"text": "hello"}\n'


def test_a_tenant_directory_that_is_a_link_opens_nothing(http, bed):
    theirs = upload(http, bed, "globex", "globex data")
    acme = bed.settings.files_dir("acme")
    if acme.exists():
        for p in acme.iterdir():
            p.unlink()
        acme.rmdir()
    os.symlink(bed.settings.files_dir("globex"), acme)  # planted: acme's namespace now points at globex's
    try:
        auth = bed.auth("acme")
        assert http.get("/files", headers=auth).json()["data"] == []
        assert http.get(f"/files/{theirs['id']}", headers=auth).status_code == 404
        assert http.get(f"/files/{theirs['id']}/content", headers=auth).status_code == 404
        r = http.post("/finetune", json={**bed.spec(), "data": {"path": theirs["id"]}}, headers=auth)
        assert_422_naming(r, "data.path")
        r = http.post("/files", content=b'{"text": "x"}\n', headers=auth)
        assert r.status_code == 500 and "Traceback" not in r.text  # refused: nothing written through the link
        assert len(list(bed.settings.files_dir("globex").glob("file-*.jsonl"))) == 1
    finally:
        acme.unlink()


def test_uploads_are_checked_without_torch(tmp_path):
    """The API's image has neither torch nor numpy (k8s/Dockerfile's api stage): the upload check needs neither."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = sys.modules["numpy"] = None  # any import of them fails
        from fastapi.testclient import TestClient
        from api.app import create_app
        from api.settings import ApiSettings
        settings = ApiSettings(api_keys={{"k-1": "acme"}}, uploads_dir={str(tmp_path)!r}, rate_limit_per_s=0)
        with TestClient(create_app(object(), settings)) as http:
            ok = http.post("/files", content=b'{{"text": "hi"}}\\n', headers={{"Authorization": "Bearer k-1"}})
            bad = http.post("/files", content=b'{{"txt": "hi"}}\\n', headers={{"Authorization": "Bearer k-1"}})
        print(ok.status_code, ok.json()["num_examples"], bad.status_code, bad.json()["error"]["code"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["201", "1", "422", "invalid_file"]


# ---- the OpenAI-compatible routes pass the same edge -----------------------------------------------------


def assert_400_param(r, param):
    """A /v1 refusal: OpenAI's status and envelope, naming the parameter."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "Traceback" not in r.text
    return err


@pytest.fixture()
def catalogue(bed):
    bed.settings.model_catalogue = {"tiny-1g": bed.root / "models" / "1GiB"}
    yield "tiny-1g"
    bed.settings.model_catalogue = {}


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(value=PARAM_TEXT, where=st.sampled_from(["file_id", "content", "delete", "after", "job_after", "job_id",
                                                "events_after"]))
def test_openai_path_and_query_parameters_are_checked(http, bed, value, where):
    auth = bed.auth("acme")
    enc = quote(value, safe="")
    r = {
        "file_id": lambda: http.get(f"/v1/files/{enc}", headers=auth),
        "content": lambda: http.get(f"/v1/files/{enc}/content", headers=auth),
        "delete": lambda: http.delete(f"/v1/files/{enc}", headers=auth),
        "after": lambda: http.get("/v1/files", params={"after": value}, headers=auth),
        "job_after": lambda: http.get("/v1/fine_tuning/jobs", params={"after": value}, headers=auth),
        "job_id": lambda: http.get(f"/v1/fine_tuning/jobs/{enc}", headers=auth),
        "events_after": lambda: http.get("/v1/fine_tuning/jobs/job-000000000000/events", params={"after": value},
                                         headers=auth),
    }[where]()
    assert r.status_code < 500, r.text
    if problem(value) is not None and "bytes long" not in problem(value):
        field = {"content": "file_id", "delete": "file_id", "job_after": "after", "events_after": "after"}.get(
            where, where)
        assert_400_param(r, field)
    assert value not in r.text or problem(value) is None  # a refused value is never echoed raw


@pytest.mark.parametrize("field,value", [
    ("model", "tiny\x00-1g"),
    ("model", "tiny-\ud800"),
    ("training_file", "file-\n"),
    ("suffix", "line one\nforged line"),
    ("suffix", "bot \udfff"),
    ("suffix", "bot\u200b"),
    ("suffix", "\u202ebot"),
    ("integrations", [{"type": "wandb", "wandb": {"project": "p\x1b[31m"}}]),
    ("spec", {"name": "x\x00"}),
])
def test_openai_create_checks_every_string(http, bed, catalogue, field, value):
    upload_id = upload(http, bed, "acme")["id"]
    body = {"model": catalogue, "training_file": upload_id, field: value}
    r = post_json(http, "/v1/fine_tuning/jobs", body, bed.auth("acme"))
    err = assert_400_param(r, {"integrations": "integrations[0].wandb.project", "spec": "name"}.get(field, field))
    assert "\x00" not in err["message"] and "\n" not in err["message"]
    ok = post_json(http, "/v1/fine_tuning/jobs", {"model": catalogue, "training_file": upload_id}, bed.auth("acme"))
    assert ok.status_code == 200, ok.text
    r = post_json(http, "/v1/fine_tuning/jobs", {"model": catalogue, "training_file": upload_id},
                  {**bed.auth("acme"), "Idempotency-Key": "key\x01"})
    assert_400_param(r, "Idempotency-Key")
    reads_still_work(http, bed, "acme")
    assert http.get("/v1/fine_tuning/jobs", headers=bed.auth("acme")).status_code == 200


def test_openai_uploads_are_checked_as_they_stream_within_the_tenants_limits(tmp_path):
    bed = make_testbed(tmp_path, max_upload_line_bytes=64, max_files_per_tenant=1)
    try:
        with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
            auth = bed.auth("acme")
            long_line = json.dumps({"text": "x" * 100}).encode() + b"\n"
            r = http.post("/v1/files", files={"file": ("t.jsonl", long_line)}, data={"purpose": "fine-tune"},
                          headers=auth)
            err = assert_400_param(r, "body")
            assert err["code"] == "invalid_file" and "longer than 64 bytes" in err["message"]
            # a form written by hand: clients escape a control character of a file name, a form need not
            form = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
                    b'--b\r\nContent-Disposition: form-data; name="file"; filename="a\x01b.jsonl"\r\n'
                    b'Content-Type: application/octet-stream\r\n\r\n{"text": "hi"}\n\r\n--b--\r\n')
            r = http.post("/v1/files", content=form,
                          headers={**auth, "Content-Type": "multipart/form-data; boundary=b"})
            assert_400_param(r, "file")
            ok = http.post("/v1/files", files={"file": ("t.jsonl", b'{"text": "hi"}\n')},
                           data={"purpose": "fine-tune"}, headers=auth)
            assert ok.status_code == 200, ok.text
            assert ok.json()["stats"] == {"format": "text", "examples": 1, "tokens": None, "trained_tokens": None,
                                          "max_tokens": None, "mean_tokens": None, "length_histogram": [],
                                          "tokenizer": None, "truncated_pairs": None}
            over = http.post("/v1/files", files={"file": ("t.jsonl", b'{"text": "hi"}\n')},
                             data={"purpose": "fine-tune"}, headers=auth)
            assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error", over.text
            assert over.headers["retry-after"].isdigit()
            files = bed.settings.files_dir("acme")
            assert not list(files.glob(".*.part")) and len(list(files.glob("file-*.jsonl"))) == 1
    finally:
        bed.close()


@pytest.mark.parametrize("no_auth", [False, True])
def test_openai_routes_count_against_the_tenants_rate(tmp_path, no_auth):
    keys = {"api_keys": {}, "insecure_no_auth": True} if no_auth else {}
    bed = make_testbed(tmp_path, rate_limit_per_s=0.01, rate_limit_burst=3, **keys)
    try:
        with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
            auth = {} if no_auth else bed.auth("acme")
            assert [http.get("/v1/models", headers=auth).status_code for _ in range(3)] == [200] * 3
            r = http.get("/v1/fine_tuning/jobs", headers=auth)
            assert r.status_code == 429 and r.headers["retry-after"].isdigit(), r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert http.get("/finetune", headers=auth).status_code == 429  # one bucket for both APIs
    finally:
        bed.close()


def test_openai_503_bodies_name_nothing_internal(bed):
    inside = "coordinator did not answer list: ActorDiedError actor_id=9f2c1a5e0b3d4f6a, ip=10.42.0.17"

    class Down:
        def list(self, *args, **kwargs):
            raise CoordinatorUnavailable(inside)

    with TestClient(create_app(Down(), bed.settings), raise_server_exceptions=False) as http:
        r = http.get("/v1/fine_tuning/jobs", headers=bed.auth("acme"))
    assert r.status_code == 503 and r.headers["retry-after"].isdigit()
    for secret in ("9f2c1a5e", "10.42.0.17", "Actor"):
        assert secret not in r.text, r.text
    assert r.json()["error"] == {"message": "the coordinator is not answering; retry in a few seconds",
                                 "type": "server_error", "param": None, "code": "unavailable"}


def test_openai_events_page_newest_first_without_reading_the_whole_history(bed, catalogue):
    auth = bed.auth("acme")

    class Counting:
        """The testbed's client, remembering the `after_seq` of each events call."""

        def __init__(self, inner):
            self.inner, self.afters, self.returned = inner, [], []

        def events(self, tenant, job_id, after_seq=0, limit=None):
            self.afters.append(after_seq)
            self.returned.append(len(got := self.inner.events(tenant, job_id, after_seq, limit)))
            return got

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counting = Counting(bed.client)
    with TestClient(create_app(counting, bed.settings), raise_server_exceptions=False) as http:
        job = post_json(http, "/v1/fine_tuning/jobs", {"model": catalogue, "training_file": upload(http, bed, "acme")[
            "id"], "hyperparameters": {"n_epochs": 1}, "spec": {"training": {"max_steps": 12}}}, auth).json()
        deadline = time.monotonic() + 30
        while http.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json()["status"] != "succeeded":
            assert time.monotonic() < deadline, "the job did not finish"
        every = http.get(f"/finetune/{job['id']}/events", params={"limit": 1000}, headers=auth).json()["data"]
        seqs = [e["seq"] for e in every]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > 8
        counting.afters.clear()
        pages, after = [], None
        while True:
            params = {"limit": 3, **({"after": after} if after else {})}
            page = http.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params=params, headers=auth).json()
            pages += [int(e["id"].rsplit("-", 1)[1]) for e in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert pages == seqs[::-1]  # every event once, newest first
        assert all(a >= len(seqs) - 3 * (i + 1) - 1 for i, a in enumerate(counting.afters))  # a window each
        counting.returned.clear()  # the native route reads a page (and one more, to say has_more), not the rest
        first = http.get(f"/finetune/{job['id']}/events", params={"limit": 3}, headers=auth).json()
        assert [e["seq"] for e in first["data"]] == seqs[:3] and first["has_more"] and counting.returned == [4]


def test_the_final_tar_never_follows_a_link(tmp_path):
    import io
    import tarfile

    from api.outputs import TarStream

    final, secret = tmp_path / "final", tmp_path / "secret"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"w" * 1000)
    secret.write_bytes(b"s" * 1000)
    os.symlink(secret, final / "planted")  # a link in the directory is no output
    whole = b"".join(TarStream(final, "job-final"))
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        assert tar.getnames() == ["job-final", "job-final/model.safetensors"]
    archive = TarStream(final, "job-final")
    (final / "model.safetensors").unlink()
    os.symlink(secret, final / "model.safetensors")  # swapped for a link after the listing
    with pytest.raises(OSError):
        b"".join(archive)
