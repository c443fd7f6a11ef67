"""The Ray Jobs CLI path against a `ray start --head` cluster on 127.0.0.1.

`ray job submit -- horizon-ray finetune --config job.yaml` runs finetune as the Ray job's entrypoint; with
the service's coordinator in the cluster, finetune hands the spec to it and follows the job: the job
shows in the service's job list, trains on a node chosen by the coordinator, and `ray job submit` exits
non-zero when the job fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.serving import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-grpc-port",
              "--dashboard-agent-listen-port", "--metrics-export-port", "--runtime-env-agent-port",
              "--node-manager-port", "--object-manager-port")


def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group we started (its own session: only our Ray processes), then SIGKILL what
    is left (`ray start --block` drains for up to 30 s on SIGTERM; nothing of ours needs draining)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


KEY = "rayjobs-k-0d5e2b97f4a1"  # tenant rayjobs's API key: a Ray job declares its tenant by it


@pytest.fixture(scope="module")
def ray_head(job_files):
    temp = Path(tempfile.mkdtemp(prefix="hr-ray-", dir="/tmp"))  # short: Ray's socket paths must fit
    ports = dict(zip(PORT_FLAGS, (free_port() for _ in PORT_FLAGS)))
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--num-cpus", "2",
           "--temp-dir", str(temp), "--disable-usage-stats"]
    for flag, port in ports.items():
        cmd += [flag, str(port)]
    log = open(temp / "ray-start.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    serve = None
    try:
        address = f"127.0.0.1:{ports['--port']}"
        dashboard = f"http://127.0.0.1:{ports['--dashboard-port']}"
        token_auth = _wait_for_dashboard(dashboard, head, temp)
        root = temp / "service"
        serve_log = temp / "serve.log"
        # the coordinator's gate: the tenant's key, and the roots a spec may read
        serve_env = {**env, "HORIZON_API_KEYS": f"{KEY}=rayjobs", "HORIZON_DATA_ROOTS": str(job_files["home"]),
                     "HORIZON_MODEL_ROOTS": str(job_files["home"])}
        with open(serve_log, "w") as f:
            serve = subprocess.Popen(
                [sys.executable, "-m", "horizon_ray", "serve", "--address", address, "--no-api", "--root",
                 str(root)], env=serve_env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 180
        while "coordinator and agents running" not in serve_log.read_text():
            assert serve.poll() is None and time.time() < deadline, serve_log.read_text()
            time.sleep(0.5)
        # `serve` found the token on its own (connect_ray); Ray's own CLI, given an explicit address, reads it
        # only with RAY_AUTH_MODE=token, as Ray's documentation tells its users
        cli_env = {**env, "RAY_AUTH_MODE": "token"} if token_auth else dict(env)
        cli_env["HORIZON_API_KEY"] = KEY  # horizon-ray status acts as tenant rayjobs
        yield {"address": address, "dashboard": dashboard, "env": cli_env, "temp": temp, "root": root}
    finally:
        if serve is not None:
            stop_group(serve)
        stop_group(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_dashboard(url: str, head: subprocess.Popen, temp: Path) -> bool:
    """Wait until the dashboard answers; whether it asks for Ray's token authentication."""
    import httpx

    deadline = time.time() + 300  # a loaded 2-core machine has taken over 2 minutes
    while time.time() < deadline:
        assert head.poll() is None, (temp / "ray-start.log").read_text()
        try:
            # 401: up, with token authentication (Ray turns it on once ~/.ray/auth_token exists, which a
            # local ray.init() elsewhere in the suite creates); the Ray CLI and ray.init read that token
            status = httpx.get(f"{url}/api/version", timeout=2).status_code
            if status in (200, 401):
                return status == 401
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("the Ray dashboard did not come up:\n" + (temp / "ray-start.log").read_text())


@pytest.fixture(scope="module")
def job_files(tmp_path_factory):
    from horizon_ray.job.demo import prepare_demo_assets

    home = tmp_path_factory.mktemp("rayjobs")
    demo, _ = prepare_demo_assets(home)
    data = home / "train.jsonl"
    data.write_text("".join(demo.train_path.read_text().splitlines(keepends=True)[:64]))
    base = {"model": {"path": str(demo.model_dir)},
            "data": {"path": str(data), "format": "messages", "eval_fraction": 0.0},
            "training": {"max_steps": 2, "micro_batch_size": 2, "seq_len": 64, "schedule": {"type": "constant"}},
            "engine": {"device": "cpu"}}
    good, bad = home / "job.yaml", home / "bad.yaml"
    # relative: in the tenant's output namespace, <jobs_root>/rayjobs/
    good.write_text(yaml.safe_dump({**base, "output_dir": "out-good"}))
    bad.write_text(yaml.safe_dump({**base, "data": {"path": str(home / "missing.jsonl")}, "output_dir": "out-bad"}))
    return {"good": good, "bad": bad, "home": home}


def ray_job_submit(head, submission_id: str, config: Path) -> subprocess.CompletedProcess:
    runtime_env = json.dumps({"env_vars": {"HORIZON_API_KEY": KEY}})
    return subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", head["dashboard"], "--submission-id", submission_id,
         "--runtime-env-json", runtime_env, "--", str(BIN / "horizon-ray"), "finetune", "--config",
         str(config), "--no-progress"],
        env=head["env"], capture_output=True, text=True, timeout=400, cwd=ROOT)


def test_ray_job_submit_runs_the_spec_through_the_coordinator(ray_head, job_files):
    out = ray_job_submit(ray_head, "hr-good-1", job_files["good"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted job job-" in out.stdout and "succeeded" in out.stdout, out.stdout

    status = subprocess.run([sys.executable, "-m", "horizon_ray", "status", "--address", ray_head["address"],
                             "--json"], env=ray_head["env"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert status.returncode == 0, status.stderr
    jobs = json.loads(status.stdout)["jobs"]
    assert jobs, "finetune trained inside the Ray job instead of handing the spec to the coordinator"
    assert [(j["name"], j["status"], j["idempotency_key"]) for j in jobs] == [
        ("hr-good-1", "succeeded", "ray-job:hr-good-1")]
    out = ray_head["root"] / "jobs" / "rayjobs" / "out-good"
    assert jobs[0]["output_dir"] == str(out)
    assert (out / "final" / "config.json").is_file()
    assert jobs[0]["node_id"] is not None and jobs[0]["attempts"] == 1

    # a spec naming a file that is not under the roots is refused by the coordinator's gate: no job, exit non-zero
    out = ray_job_submit(ray_head, "hr-bad-1", job_files["bad"])
    assert out.returncode != 0, out.stdout
    assert "was not found under the roots this service lets you read" in out.stdout, out.stdout
    status = subprocess.run([sys.executable, "-m", "horizon_ray", "status", "--address", ray_head["address"],
                             "--json"], env=ray_head["env"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert "hr-bad-1" not in {j["name"] for j in json.loads(status.stdout)["jobs"]}
