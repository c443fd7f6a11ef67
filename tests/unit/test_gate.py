"""The coordinator's gate (horizon_ray/cluster/gate.py): who a call acts as, and what paths its spec may name;
the engines' allow-list environment; serve's refusals around keys and Ray's token."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from horizon_ray.cluster.errors import InvalidSpec, Unauthorized
from horizon_ray.cluster.gate import Gate, GateConfig, key_digest, service_credential
from horizon_ray.cluster.messages import NodeInfo, Reservation

KEYS = {"alice-7c1e0f2b9d": "alice", "bob-4a8d33e1c0": "bob"}


@pytest.fixture
def roots(tmp_path):
    uploads, jobs, data, models = (tmp_path / n for n in ("uploads", "jobs", "data", "models"))
    for tenant in ("alice", "bob"):
        (uploads / tenant).mkdir(parents=True)
        (uploads / tenant / "file-0123456789abcdef01234567.jsonl").write_text("{}\n")
    data.mkdir()
    (data / "public.jsonl").write_text("{}\n")
    (models / "tiny").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.jsonl").write_text("{}\n")
    (data / "link.jsonl").symlink_to(outside / "secret.jsonl")
    return {"uploads": uploads, "jobs": jobs, "data": data, "models": models, "outside": outside}


def gate(roots, keys=KEYS, **extra) -> Gate:
    config = GateConfig.from_keys(keys, uploads_dir=roots["uploads"], jobs_root=roots["jobs"],
                                  data_roots=[roots["data"]], model_roots=[roots["models"]],
                                  model_catalogue={"tiny-model": roots["models"] / "tiny"}, **extra)
    return Gate(GateConfig.from_wire(config.to_wire()))  # as the actor gets it


def spec(roots, data: str, **more) -> dict:
    return {"model": {"path": str(roots["models"] / "tiny")}, "data": {"path": data}, **more}


def test_the_coordinator_keeps_digests_of_the_keys_never_the_keys(roots):
    config = GateConfig.from_keys(KEYS, uploads_dir=roots["uploads"], jobs_root=roots["jobs"])
    wire = repr(config.to_wire())
    assert all(key not in wire for key in KEYS)
    assert config.key_digests == {key_digest(k): t for k, t in KEYS.items()}
    assert service_credential(KEYS) not in wire and config.service_digest == key_digest(service_credential(KEYS))


def test_a_call_acts_as_the_tenant_of_its_key_only(roots):
    g = gate(roots)
    # `ready` is a probe anyone who reaches Ray may make (finetune in a Ray job asks it before it submits)
    assert g.admit("ready", (), {}, None)[0].tenant is None
    with pytest.raises(Unauthorized, match="needs an API key: set HORIZON_API_KEY"):
        g.admit("whoami", (), {}, None)
    with pytest.raises(Unauthorized, match="needs an API key: set HORIZON_API_KEY"):
        g.admit("list", ("bob",), {}, None)
    with pytest.raises(Unauthorized, match="invalid API key"):
        g.admit("list", ("bob",), {}, "bob-4a8d33e1c")  # one character short
    with pytest.raises(Unauthorized, match="tenant 'alice''s; it cannot act as tenant 'bob'"):
        g.admit("cancel", ("bob", "job-1"), {}, "alice-7c1e0f2b9d")
    who, args, _ = g.admit("cancel", ("bob", "job-1"), {}, "bob-4a8d33e1c0")
    assert who.tenant == "bob" and args == ("bob", "job-1")
    # a tenant's queue(None) is its own queue, never every tenant's
    assert g.admit("queue", (None,), {}, "alice-7c1e0f2b9d")[1] == ("alice",)
    # the API's credential names any tenant; one tenant's key is not it
    assert g.admit("get", ("bob", "job-1"), {}, service_credential(KEYS))[0].tenant is None
    assert service_credential({"alice-7c1e0f2b9d": "alice"}) != service_credential(KEYS)
    # without keys (serve --insecure-no-auth) every call is tenant default
    assert gate(roots, keys={}).admit("list", ("default",), {}, None)[0].tenant == "default"
    with pytest.raises(Unauthorized):
        gate(roots, keys={}).admit("list", ("bob",), {}, None)


def test_a_tenant_sees_no_other_tenants_job_in_a_ledger(roots):
    node = NodeInfo(node_id="a", ram_bytes=1 << 30,
                    ledger=[Reservation(job_id="job-a", host_bytes=1, gpu_bytes=0, since=0, tenant="alice"),
                            Reservation(job_id="job-b", host_bytes=2, gpu_bytes=0, since=0, tenant="bob")])
    g = gate(roots)
    who = g.principal("alice-7c1e0f2b9d")
    shown = g.shown(who, "nodes", [node])[0]
    assert [r.job_id for r in shown.ledger] == ["job-a", "(another tenant's)"]
    assert [r.tenant for r in shown.ledger] == ["alice", None] and shown.ledger[1].host_bytes == 2
    assert g.shown(g.principal(service_credential(KEYS)), "nodes", [node])[0].ledger[1].job_id == "job-b"


def test_every_path_of_a_spec_is_confined(roots):
    g = gate(roots)
    bob_upload = str(roots["uploads"] / "bob" / "file-0123456789abcdef01234567.jsonl")
    alice_upload = bob_upload.replace("/bob/", "/alice/")
    with pytest.raises(InvalidSpec, match="outside the roots this service lets you read"):
        g.confine("alice", spec(roots, bob_upload))
    assert g.confine("bob", spec(roots, bob_upload))["data"]["path"] == bob_upload
    assert g.confine("alice", spec(roots, alice_upload))["data"]["path"] == alice_upload
    assert g.confine("alice", spec(roots, "public.jsonl"))["data"]["path"] == str(roots["data"] / "public.jsonl")
    for bad, why in ((str(roots["outside"] / "secret.jsonl"), "outside the roots"),
                     (str(roots["data"] / "link.jsonl"), "outside the roots"),  # a link out of its root
                     ("../elsewhere/secret.jsonl", "'..'"), ("missing.jsonl", "was not found")):
        with pytest.raises(InvalidSpec, match=why):
            g.confine("alice", spec(roots, bad))
    # a data root that holds the tenants' namespaces opens no other tenant's files
    wide = Gate(GateConfig.from_keys(KEYS, uploads_dir=roots["uploads"], jobs_root=roots["jobs"],
                                     data_roots=[roots["uploads"]], model_roots=[roots["models"]]))
    with pytest.raises(InvalidSpec, match="another tenant's namespace"):
        wide.confine("alice", spec(roots, "bob/file-0123456789abcdef01234567.jsonl"))
    # models: a catalogue name or a directory under a model root
    assert g.confine("alice", {"model": {"path": "tiny-model"}})["model"]["path"] == str(roots["models"] / "tiny")
    with pytest.raises(InvalidSpec, match="model.path"):
        g.confine("alice", {"model": {"path": str(roots["outside"])}})
    # output_dir: inside <jobs_root>/<tenant>/ only
    out = g.confine("alice", spec(roots, "public.jsonl", output_dir="my-run"))["output_dir"]
    assert out == str(roots["jobs"] / "alice" / "my-run")
    for bad in (str(roots["jobs"] / "bob" / "run"), str(roots["outside"]), "../bob/run", str(roots["jobs"] / "alice")):
        with pytest.raises(InvalidSpec, match="output_dir"):
            g.confine("alice", spec(roots, "public.jsonl", output_dir=bad))


def test_a_tracker_url_names_an_approved_host_only(roots):
    mlflow = {"integrations": {"mlflow": {"tracking_uri": "http://169.254.169.254/latest/meta-data"}}}
    with pytest.raises(InvalidSpec, match="host '169.254.169.254', which the operator has not approved"):
        gate(roots).confine("alice", spec(roots, "public.jsonl", **mlflow))
    ok = {"integrations": {"mlflow": {"tracking_uri": "https://MLflow.internal:5000"}}}
    g = gate(roots, tracker_hosts=["mlflow.internal"])
    assert g.confine("alice", spec(roots, "public.jsonl", **ok))["integrations"] == ok["integrations"]
    with pytest.raises(InvalidSpec, match="not approved"):
        g.confine("alice", spec(roots, "public.jsonl", **mlflow))


def test_engines_start_from_an_allow_list_environment():
    from horizon_ray.cluster.engine_env import engine_base_env

    node = {"PATH": "/usr/bin", "HOME": "/home/s", "OMP_NUM_THREADS": "4", "HORIZON_RAY_HOME": "/h",
            "CUDA_VISIBLE_DEVICES": "0", "RAY_AUTH_TOKEN": "t0k", "RAY_AUTH_TOKEN_PATH": "/s/ray_token",
            "RAY_AUTH_MODE": "token", "HORIZON_API_KEYS": "k=alice", "MLFLOW_TRACKING_TOKEN": "m",
            "AWS_SECRET_ACCESS_KEY": "a", "WANDB_API_KEY": "w", "RAY_ADDRESS": "127.0.0.1:1"}
    env = engine_base_env(node)
    assert env == {k: node[k] for k in ("PATH", "HOME", "OMP_NUM_THREADS", "HORIZON_RAY_HOME",
                                        "CUDA_VISIBLE_DEVICES")}
    # the node's operator lets a tracker's token through; its explicit env is its own, Ray's token never
    env = engine_base_env({**node, "HORIZON_ENGINE_ENV": "MLFLOW_TRACKING_TOKEN"},
                          {"EXTRA": "1", "RAY_AUTH_TOKEN": "t0k", "HORIZON_API_KEYS_FILE": "/k"})
    assert env["MLFLOW_TRACKING_TOKEN"] == "m" and env["EXTRA"] == "1"
    assert not {"RAY_AUTH_TOKEN", "HORIZON_API_KEYS_FILE", "WANDB_API_KEY"} & set(env)


def serve_args(*argv: str) -> argparse.Namespace:
    from horizon_ray.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_needs_keys_for_the_gate_and_loopback_without_them(tmp_path, monkeypatch):
    from horizon_ray.commands import serve

    for var in ("HORIZON_API_KEYS", "HORIZON_API_KEYS_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="also with --no-api: the coordinator checks the keys"):
        serve.run(serve_args("--address", "127.0.0.1:1", "--no-api", "--root", str(tmp_path)))
    with pytest.raises(ValueError, match="only on loopback: drop --host 0.0.0.0"):
        serve.run(serve_args("--insecure-no-auth", "--host", "0.0.0.0", "--root", str(tmp_path)))


def test_the_ray_token_is_made_once_readable_by_its_user_only(tmp_path, monkeypatch):
    from horizon_ray.cluster.local import use_ray_token

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    assert use_ray_token(tmp_path, create=False) is None and "RAY_AUTH_MODE" not in os.environ
    path = use_ray_token(tmp_path, create=True)
    token = path.read_text()
    assert len(token) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(path)
    assert token not in "".join(os.environ.values())
    assert use_ray_token(tmp_path, create=True) == path and path.read_text() == token  # the same one again
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        use_ray_token(tmp_path, create=False)


def test_a_ray_jobs_entrypoint_finds_the_cluster_of_its_job_server():
    """Ray hands an entrypoint RAY_ADDRESS of the newest cluster of its temp dir; the job supervisor that started
    it (an ancestor, a Ray worker) names its own cluster with --gcs-address."""
    import subprocess
    import sys

    child = "from horizon_ray.cluster.follow import job_server_cluster as f; print(f())"
    # sh keeps running after python (the `; true`), so python's parent is the process with --gcs-address
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c '{child}'; true", "--gcs-address=10.0.0.9:6379"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": "10.0.0.1:1"})
    assert out.stdout.strip() == "10.0.0.9:6379", out.stderr
    from horizon_ray.cluster.follow import job_server_cluster

    assert job_server_cluster() is None  # pytest runs in no Ray job


@pytest.fixture
def api(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.testing import make_testbed

    bed = make_testbed(tmp_path)
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
        yield bed, http
    bed.close()


def test_the_apis_gate_edges(api, monkeypatch):
    """Duplicate Authorization headers are refused, wrong keys are rate limited per address, /metrics needs a
    key unless the operator opens it, and a served API takes no short key."""
    from api.auth import WRONG_KEY_BURST
    from api.settings import ApiSettings

    bed, http = api
    good = bed.auth("acme")["Authorization"]
    two = http.get("/finetune", headers=[("Authorization", good), ("Authorization", "Bearer nope")])
    assert two.status_code == 400 and "more than one Authorization header" in two.json()["error"]["message"]
    assert http.get("/finetune", headers={"Authorization": good}).status_code == 200
    codes = [http.get("/finetune", headers={"Authorization": f"Bearer wrong-{i}"}).status_code
             for i in range(WRONG_KEY_BURST + 2)]
    assert codes[:WRONG_KEY_BURST] == [401] * WRONG_KEY_BURST and codes[-1] == 429
    limited = http.get("/finetune", headers={"Authorization": "Bearer wrong"})
    assert int(limited.headers["Retry-After"]) >= 1
    assert http.get("/finetune", headers={"Authorization": good}).status_code == 200  # a valid key still works
    assert http.get("/metrics").status_code == 401
    bed.settings.metrics_open = True
    assert http.get("/metrics").status_code == 200
    with pytest.raises(ValueError, match="has 1 characters; give it at least 16"):
        ApiSettings(api_keys={"k": "me"}).check_served_keys()
    monkeypatch.setenv("HORIZON_API_KEYS", "k=me")
    with pytest.raises(ValueError, match="has 1 characters"):
        serve_run = __import__("horizon_ray.commands.serve", fromlist=["run"]).run
        serve_run(serve_args("--address", "127.0.0.1:1", "--no-api", "--root", str(bed.settings.jobs_root)))
