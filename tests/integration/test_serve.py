"""`horizon-ray serve` as the README starts it: the API, the coordinator and Ray's job server of one cluster.

One service for the module (a simulated node on this machine, the demo model in a catalogue): a job created
with the OpenAI SDK trains and its model downloads from the API, which finds it where the coordinator put it
(one setting, the jobs root, for both); `ray job submit -- horizon-ray finetune ...`, with no address, reaches the
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

KEY, TENANT = "test-key-7f3a9c2e0b", "me"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from horizon_ray.job.demo import prepare_demo_assets

    home = tmp_path_factory.mktemp("serve-home")
    assets, _ = prepare_demo_assets(home)
    env = user_env(home, HORIZON_API_KEYS=f"{KEY}={TENANT}", HORIZON_MODEL_ROOTS=str(assets.root),
                   HORIZON_MODEL_CATALOGUE=f"tiny-demo={assets.model_dir}", HORIZON_DATA_ROOTS=str(assets.root))
    ray_port, dashboard_port = free_port(), free_port()  # Ray's ports: Ray takes no 0 for them
    args = ["horizon-ray", "serve", "--simulate-nodes", "a=8GiB", "--port", "0", "--ray-port", str(ray_port),
            "--dashboard-port", str(dashboard_port)]
    with serving(args, env, home / "serve.log") as served:
        yield {"url": served.url, "env": env, "home": home, "assets": assets,
               "log": home / "serve.log", "ray_port": ray_port, "dashboard_port": dashboard_port}


def test_a_job_created_with_the_openai_sdk_trains_and_its_model_downloads(service):
    """The README's serve path end to end, through the OpenAI SDK: upload, create (a catalogue model), follow,
    then download final/ in one request from where the coordinator wrote it (one jobs root for both)."""
    import io
    import tarfile

    import openai

    client = openai.OpenAI(base_url=f"{service['url']}/v1", api_key=KEY, max_retries=0, timeout=60)
    lines = service["assets"].train_path.read_text().splitlines(keepends=True)[:48]
    f = client.files.create(file=("train.jsonl", "".join(lines).encode()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="tiny-demo", training_file=f.id, suffix="e2e", extra_body={
        "spec": {"training": {"max_steps": 4, "seq_len": 64, "schedule": {"warmup_steps": 0}},
                 "engine": {"device": "cpu"}}})
    deadline = time.monotonic() + 300
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job {job.id} still {job.status} after 300 s"
        time.sleep(1)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:tiny-demo:{TENANT}:e2e:{job.id}"
    out = service["home"] / "service" / "jobs" / TENANT / job.id  # the coordinator's jobs root under serve
    with httpx.Client(base_url=service["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        config = http.get(f"{job.model_extra['outputs_url']}/final/config.json")
        assert config.status_code == 200 and config.content == (out / "final" / "config.json").read_bytes()
        tar = http.get(job.model_extra["final_model_url"])
    assert tar.status_code == 200, tar.text
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
        weights = archive.extractfile(f"{job.id}-final/model.safetensors").read()
    assert weights == (out / "final" / "model.safetensors").read_bytes()


def test_ray_job_submit_with_no_address_reaches_the_service(service, tmp_path):
    """The README's `ray job submit -- horizon-ray finetune --config job.yaml`, as written: serve started Ray's
    job server, and the entrypoint hands the spec to this service's coordinator."""
    assets = service["assets"]
    spec = {"model": {"path": str(assets.model_dir)}, "data": {"path": str(assets.train_path), "eval_fraction": 0},
            "training": {"max_steps": 3, "seq_len": 64, "schedule": {"warmup_steps": 0}},
            "engine": {"device": "cpu"}, "output_dir": "from-ray-job"}  # in the tenant's output namespace
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    # Ray's token of the cluster serve started, and the tenant's key for the job (its runtime env)
    token = service["home"] / "service" / "ray_token"
    env = {**service["env"], "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "HORIZON_API_KEY": KEY}
    # the entrypoint runs in the cluster's working directory, not this one: the spec is named absolutely
    out = subprocess.run(["ray", "job", "submit", "--runtime-env-json", json.dumps({"env_vars": {
                          "HORIZON_API_KEY": KEY}}), "--", "horizon-ray", "finetune", "--config",
                          str(tmp_path / "job.yaml")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"(tenant {TENANT})" in out.stdout and "succeeded" in out.stdout, out.stdout
    done = service["home"] / "service" / "jobs" / TENANT / "from-ray-job"
    assert (done / "final" / "config.json").is_file()
    # the CLI acts as the tenant of its key: the Ray job is among its jobs, as among the dashboard's
    status = subprocess.run(["horizon-ray", "status", "--json"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 0 and f"acting as tenant {TENANT}" in status.stderr, status.stderr
    jobs = json.loads(status.stdout)["jobs"]
    assert [j["status"] for j in jobs if j["output_dir"] == str(done)] == ["succeeded"], jobs
    log = service["log"].read_text()
    assert f"ray job submit --address http://127.0.0.1:{service['dashboard_port']} --runtime-env-json" in log
    # on the ports it was given
    assert f"Ray cluster 127.0.0.1:{service['ray_port']} " in log


def test_serve_refuses_to_start_an_api_without_keys(tmp_path):
    env = user_env(tmp_path)
    out = subprocess.run(["horizon-ray", "serve", "--simulate-nodes", "a=8GiB"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr.strip()
    assert err.startswith("error: the service has no API key") and "HORIZON_API_KEYS" in err
    assert "--insecure-no-auth" in err
    assert "Traceback" not in err and "starting a local Ray cluster" not in out.stdout  # refused before Ray
    help_text = subprocess.run(["horizon-ray", "serve", "--help"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=60).stdout
    from api.settings import SETTINGS

    assert all(s.env in help_text for s in SETTINGS)


def test_sigterm_stops_serve_as_ctrl_c_does(tmp_path):
    """`kill PID` (systemd, docker stop): serve stops its service and cluster and exits 0, without a traceback
    or Ray's stack dump. Its API was on the port the OS picked for --port 0, which serve printed and wrote to
    <root>/api_port until it stopped."""
    import os
    import signal

    from horizon_ray.commands.serve import API_PORT_FILE

    env = user_env(tmp_path, HORIZON_API_KEYS=f"{KEY}={TENANT}")
    args = ["horizon-ray", "serve", "--simulate-nodes", "a=4GiB", "--port", "0", "--dashboard-port", "0",
            "--no-demo-model"]
    log, port_file = tmp_path / "serve.log", tmp_path / "service" / API_PORT_FILE
    with serving(args, env, log) as served:
        port = int(port_file.read_text())
        assert port > 0 and served.url == f"http://127.0.0.1:{port}", (port, served.url)
        assert f"OpenAI-compatible at http://127.0.0.1:{port}/v1" in log.read_text()
        ready = httpx.get(f"{served.url}/readyz", timeout=30)
        assert ready.status_code == 200, ready.text
        os.kill(served.proc.pid, signal.SIGTERM)
        assert served.proc.wait(timeout=120) == 0, log.read_text()
    text = log.read_text()
    assert "serve: stopping" in text and "Traceback" not in text and "Stack (most recent call first)" not in text, text
    assert not port_file.exists()  # no API listens on it any more
