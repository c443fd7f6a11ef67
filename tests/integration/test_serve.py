"""`horizon-ray serve` as the README starts it: the API, the coordinator and Ray's job server of one cluster.

One service for the module (a simulated node on this machine, the demo model in a catalogue): a job created
over REST trains and its model downloads from the API, which finds it where the coordinator put it (one
setting, the jobs root, for both); `ray job submit -- horizon-ray finetune ...`, with no address, reaches the
same service; and serve refuses to start an API that has no key.
"""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest
import yaml

from tests.serving import ROOT, free_port, serving, user_env

pytestmark = pytest.mark.integration

KEY, TENANT = "test-key-7f3a9c", "me"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from horizon_ray.job.demo import prepare_demo_assets

    home = tmp_path_factory.mktemp("serve-home")
    assets, _ = prepare_demo_assets(home)
    env = user_env(home, HORIZON_API_KEYS=f"{KEY}={TENANT}", HORIZON_MODEL_ROOTS=str(assets.root),
                   HORIZON_MODEL_CATALOGUE=f"tiny-demo={assets.model_dir}", HORIZON_DATA_ROOTS=str(assets.root))
    port = free_port()
    args = ["serve", "--simulate-nodes", "a=8GiB", "--port", str(port), "--dashboard-port", str(free_port())]
    with serving(args, env, home / "serve.log"):
        yield {"url": f"http://127.0.0.1:{port}", "env": env, "home": home, "assets": assets,
               "log": home / "serve.log"}


def wait_for_job(http, job_id, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while True:
        job = http.get(f"/finetune/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']} after {timeout_s} s"
        time.sleep(1)


def test_a_job_created_over_rest_downloads_its_model_from_the_api(service):
    """The README's serve path end to end: upload, create (by catalogue name), follow, download final/."""
    with httpx.Client(base_url=service["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        lines = service["assets"].train_path.read_text().splitlines(keepends=True)[:48]
        up = http.post("/files?filename=train.jsonl", content="".join(lines).encode(),
                       headers={"Content-Type": "application/x-ndjson"})
        assert up.status_code == 201, up.text
        created = http.post("/finetune", json={
            "model": {"path": "tiny-demo"}, "data": {"path": up.json()["id"], "eval_fraction": 0},
            "training": {"max_steps": 4, "seq_len": 64, "schedule": {"warmup_steps": 0}},
            "engine": {"device": "cpu"}})
        assert created.status_code == 201, created.text
        job = wait_for_job(http, created.json()["id"])
        assert job["status"] == "succeeded", job
        out = service["home"] / "service" / "jobs" / TENANT / job["id"]
        assert job["result"]["output_dir"] == str(out)  # the coordinator's jobs root: $HORIZON_RAY_HOME/service
        listed = {f["path"] for f in http.get(job["result"]["outputs_url"]).json()["data"]}
        assert {"final/config.json", "final/model.safetensors", "metrics.jsonl"} <= listed
        config = http.get(f"{job['result']['outputs_url']}/final/config.json")
        assert config.status_code == 200 and config.content == (out / "final" / "config.json").read_bytes()


def test_ray_job_submit_with_no_address_reaches_the_service(service, tmp_path):
    """The README's `ray job submit -- horizon-ray finetune --config job.yaml`, as written: serve started Ray's
    job server, and the entrypoint hands the spec to this service's coordinator."""
    assets = service["assets"]
    spec = {"model": {"path": str(assets.model_dir)}, "data": {"path": str(assets.train_path), "eval_fraction": 0},
            "training": {"max_steps": 3, "seq_len": 64, "schedule": {"warmup_steps": 0}},
            "engine": {"device": "cpu"}, "output_dir": str(tmp_path / "out")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    env = service["env"]
    # the entrypoint runs in the cluster's working directory, not this one: the spec is named absolutely
    out = subprocess.run(["ray", "job", "submit", "--", "horizon-ray", "finetune", "--config",
                          str(tmp_path / "job.yaml")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted job job-" in out.stdout and "succeeded" in out.stdout, out.stdout
    assert (tmp_path / "out" / "final" / "config.json").is_file()
    # the entrypoint runs in the cluster's environment, not this shell's: its tenant is the default one
    status = subprocess.run(["horizon-ray", "status", "--json", "--tenant", "default"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    jobs = json.loads(status.stdout)["jobs"]
    assert [j["status"] for j in jobs if j["output_dir"] == str(tmp_path / "out")] == ["succeeded"], jobs
    assert "ray job submit -- horizon-ray finetune" in service["log"].read_text()  # serve said how


def test_serve_refuses_to_start_an_api_without_keys(tmp_path):
    env = user_env(tmp_path)
    out = subprocess.run(["horizon-ray", "serve", "--simulate-nodes", "a=8GiB"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr.strip()
    assert err.startswith("error: the API has no key") and "HORIZON_API_KEYS" in err and "--insecure-no-auth" in err
    assert "Traceback" not in err and "starting a local Ray cluster" not in out.stdout  # refused before Ray
    help_text = subprocess.run(["horizon-ray", "serve", "--help"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=60).stdout
    from api.settings import SETTINGS

    assert all(s.env in help_text for s in SETTINGS)
