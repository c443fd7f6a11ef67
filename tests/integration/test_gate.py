"""The one gate, end to end: `horizon-ray serve` with two tenants' keys on a simulated node.

- Ray's job server and GCS refuse clients without the service's Ray token (`<root>/ray_token`, 0600).
- `ray job submit -- horizon-ray finetune` acts as the tenant of the HORIZON_API_KEY in its runtime env:
  alice cannot train on bob's upload; a Ray job without a key is refused.
- The CLI acts as the tenant of its key and prints it: alice neither sees bob's job nor, with a Ray client of
  her own, cancels it; bob's key does.
- serve's own /proc/<pid>/environ holds no key (it re-executes itself without them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from horizon_ray.job.metrics import METRICS_FILE
from tests.serving import BIN, ROOT, free_port, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ALICE, BOB = "alice-k-5f0e9a7d3c21", "bob-k-b81c44e07aa9"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from horizon_ray.job.demo import prepare_demo_assets

    home = tmp_path_factory.mktemp("gate")
    demo, _ = prepare_demo_assets(home / "assets")
    assets = demo.model_dir.parent
    dash = free_port()  # Ray's dashboard takes no 0; the API's port is the one serve binds for --port 0
    root = home / "service"
    env = user_env(home, HORIZON_API_KEYS=f"{ALICE}=alice,{BOB}=bob", HORIZON_MODEL_ROOTS=str(assets),
                   HORIZON_DATA_ROOTS=str(assets), HOME=str(home))  # no ~/.ray/auth_token of another cluster
    argv = [sys.executable, "-m", "horizon_ray", "serve", "--simulate-nodes", "a=2GiB", "--root", str(root),
            "--port", "0", "--dashboard-port", str(dash)]
    with serving(argv, env, home / "serve.log") as serve:
        yield {"url": serve.url, "dashboard": f"http://127.0.0.1:{dash}", "root": root,
               "env": env, "proc": serve.proc, "assets": assets, "home": home}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cli(served, *argv: str, key: str | None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in served["env"].items() if not k.startswith("HORIZON_API_")}
    if key:
        env["HORIZON_API_KEY"] = key
    return subprocess.run([str(BIN / "horizon-ray"), *argv, "--root", str(served["root"])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def ray_job(served, config: Path, key: str | None) -> subprocess.CompletedProcess:
    token = served["root"] / "ray_token"
    env = {**{k: v for k, v in served["env"].items() if not k.startswith("HORIZON_API_")},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    runtime = ["--runtime-env-json", json.dumps({"env_vars": {"HORIZON_API_KEY": key}})] if key else []
    return subprocess.run([str(BIN / "ray"), "job", "submit", "--address", served["dashboard"], *runtime, "--",
                           str(BIN / "horizon-ray"), "finetune", "--config", str(config), "--no-progress"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)


def test_rays_job_server_and_gcs_refuse_clients_without_the_token(served):
    token = served["root"] / "ray_token"
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    jobs = f"{served['dashboard']}/api/jobs/"
    refused = httpx.post(jobs, json={"entrypoint": "id"}, timeout=30)
    assert refused.status_code == 401, refused.text
    wrong = httpx.post(jobs, json={"entrypoint": "id"}, headers=bearer("0" * 64), timeout=30)
    assert wrong.status_code in (401, 403), wrong.text
    taken = httpx.post(jobs, json={"entrypoint": "true"}, headers=bearer(token.read_text()), timeout=60)
    assert taken.status_code == 200, taken.text
    # the GCS: a Ray client without the token (none, or a wrong one) does not connect
    address = (served["root"] / "ray_address").read_text().strip()
    probe = f"import ray; ray.init(address={address!r}); print('connected')"
    for extra in ({}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64}):
        env = {**{k: v for k, v in served["env"].items() if not k.startswith("RAY_AUTH")}, **extra}
        try:
            out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=90)
            assert "connected" not in out.stdout, out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            pass  # still knocking: not connected either


def test_serves_environment_holds_no_key(served):
    environ = Path(f"/proc/{served['proc'].pid}/environ").read_bytes()
    for secret in (ALICE.encode(), BOB.encode(), b"HORIZON_API_KEYS"):
        assert secret not in environ


def upload(served, key: str, text: str) -> str:
    r = httpx.post(f"{served['url']}/files", params={"filename": "train.jsonl"}, content=text.encode(),
                   headers={**bearer(key), "Content-Type": "application/x-ndjson"}, timeout=60)
    assert r.status_code in (200, 201), r.text
    return r.json()["id"]


def test_a_ray_job_acts_as_the_tenant_of_its_key(served):
    import yaml

    train = (served["assets"] / "train.jsonl").read_text().splitlines(keepends=True)[:64]
    bob_file = upload(served, BOB, "".join(train))
    bobs_path = served["root"] / "uploads" / "bob" / f"{bob_file}.jsonl"
    assert bobs_path.is_file()
    base = {"model": {"path": str(served["assets"] / "model")}, "data": {"format": "messages", "eval_fraction": 0},
            "training": {"max_steps": 2, "micro_batch_size": 2, "seq_len": 64, "schedule": {"type": "constant"}},
            "engine": {"device": "cpu"}, "output_dir": "from-ray-jobs"}  # in the tenant's output namespace
    steal = served["home"] / "steal.yaml"
    steal.write_text(yaml.safe_dump({**base, "data": {**base["data"], "path": str(bobs_path)}}))
    out = ray_job(served, steal, ALICE)
    assert out.returncode != 0, out.stdout
    assert "outside the roots this service lets you read" in out.stdout + out.stderr, out.stdout + out.stderr
    nokey = ray_job(served, steal, None)
    assert nokey.returncode != 0 and "needs an API key" in nokey.stdout + nokey.stderr, nokey.stdout
    # bob's own key trains on bob's upload, and the job is bob's: the dashboard's (REST) job list shows it
    out = ray_job(served, steal, BOB)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(tenant bob)" in out.stdout and "succeeded" in out.stdout
    listed = httpx.get(f"{served['url']}/finetune", headers=bearer(BOB), timeout=30).json()["data"]
    assert any(j["status"] == "succeeded" for j in listed)
    # its relative output_dir lands in bob's namespace of the service root, and nowhere else: not in the
    # repository, the cwd of serve and of `ray job submit` (a from-ray-jobs/ there was once committed)
    landed = served["root"] / "jobs" / "bob" / "from-ray-jobs"
    assert (landed / "final" / "model.safetensors").is_file() and (landed / METRICS_FILE).is_file()
    assert [Path(j["result"]["output_dir"]).resolve() for j in listed if j["status"] == "succeeded"] == [
        landed.resolve()]
    stray = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    assert "from-ray-jobs" not in stray and not (ROOT / "from-ray-jobs").exists(), stray
    assert httpx.get(f"{served['url']}/finetune", headers=bearer(ALICE), timeout=30).json()["data"] == []


def test_the_cli_acts_as_the_tenant_of_its_key(served):
    spec = {"model": {"path": "model"}, "data": {"path": "train.jsonl", "format": "messages", "eval_fraction": 0},
            "training": {"max_steps": 100000, "micro_batch_size": 2, "seq_len": 64}, "engine": {"device": "cpu"}}
    r = httpx.post(f"{served['url']}/finetune", json=spec, headers=bearer(BOB), timeout=60)
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    mine = cli(served, "status", "--json", key=BOB)
    assert mine.returncode == 0 and "acting as tenant bob" in mine.stderr, mine.stderr
    assert job in [j["id"] for j in json.loads(mine.stdout)["jobs"]]
    theirs = cli(served, "status", "--json", key=ALICE)
    assert theirs.returncode == 0 and "acting as tenant alice" in theirs.stderr, theirs.stderr
    assert job not in theirs.stdout  # not in alice's list, nor in a node's ledger
    assert cli(served, "status", job, key=ALICE).returncode == 2
    nokey = cli(served, "status", key=None)
    assert nokey.returncode == 2 and "needs an API key" in nokey.stderr, nokey.stderr
    # a Ray client of alice's own, naming bob, cancels nothing; bob's key does
    cancel = ("import sys; from horizon_ray.cluster.client import RayClient; from horizon_ray.cluster.local import "
              "use_ray_token; from pathlib import Path; use_ray_token(Path(sys.argv[1]), create=False); "
              "c = RayClient(open(Path(sys.argv[1]) / 'ray_address').read().strip(), credential=sys.argv[2]); "
              "print(c.cancel('bob', sys.argv[3]).status.value)")
    env = {k: v for k, v in served["env"].items() if not k.startswith("HORIZON_API_")}
    out = subprocess.run([sys.executable, "-c", cancel, str(served["root"]), ALICE, job], env=env,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "cannot act as tenant 'bob'" in out.stderr, out.stdout + out.stderr
    assert httpx.get(f"{served['url']}/finetune/{job}", headers=bearer(BOB), timeout=30).json()["status"] not in (
        "cancelling", "cancelled")
    out = subprocess.run([sys.executable, "-c", cancel, str(served["root"]), BOB, job], env=env,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() in ("cancelling", "cancelled"), out.stdout + out.stderr
    deadline = time.monotonic() + 120
    while httpx.get(f"{served['url']}/finetune/{job}", headers=bearer(BOB), timeout=30).json()["status"] != \
            "cancelled":
        assert time.monotonic() < deadline
        time.sleep(1)
