"""The tenants' API keys stay in the API process's memory: `horizon-ray serve` started with HORIZON_API_KEYS and
HORIZON_API_KEYS_FILE in its environment runs a real job, and neither serve's own exec environment (it
re-executes itself without them), the Ray processes it starts (GCS, raylets, workers, the node agents) nor the
job's engine has any HORIZON_API_* variable, a key, the key file's path or Ray's token, read from their
/proc/<pid>/environ; the engine has no RAY_* variable at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.serving import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def environ_of(proc: psutil.Process) -> bytes:
    return Path(f"/proc/{proc.pid}/environ").read_bytes()


def test_engines_and_ray_workers_get_no_api_secret(tmp_path):
    from horizon_ray.job.demo import prepare_demo_assets

    demo, _ = prepare_demo_assets(tmp_path / "assets")
    assets = demo.model_dir.parent
    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-from-the-file-9f3a: globex\n")
    port = free_port()
    env = {**os.environ, "HORIZON_API_KEYS": "sk-from-the-env-c41d=acme", "HORIZON_API_KEYS_FILE": str(keys),
           "HORIZON_MODEL_ROOTS": str(assets), "HORIZON_DATA_ROOTS": str(assets),
           "HORIZON_UPLOADS_DIR": str(tmp_path / "uploads"), "OMP_NUM_THREADS": "1",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    serve = subprocess.Popen([sys.executable, "-m", "horizon_ray", "serve", "--simulate-nodes", "a=2GiB",
                              "--root", str(tmp_path / "service"), "--port", str(port)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer sk-from-the-env-c41d"}
    try:
        deadline = time.monotonic() + 240
        while True:
            assert serve.poll() is None, serve.stdout.read()
            assert time.monotonic() < deadline, "serve did not come up within 240 s"
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        spec = {"model": {"path": "model"}, "data": {"path": "train.jsonl", "format": "messages", "eval_fraction": 0},
                "training": {"max_steps": 100000, "micro_batch_size": 2, "seq_len": 64},
                "engine": {"device": "cpu"}}
        r = httpx.post(f"{url}/finetune", json=spec, headers=auth, timeout=60)
        assert r.status_code == 201, r.text
        job = r.json()
        spec_path = f"{job['result']['output_dir']}/job.yaml"

        def engine():
            for p in psutil.Process(serve.pid).children(recursive=True):
                try:
                    if spec_path in " ".join(p.cmdline()):
                        return p
                except psutil.NoSuchProcess:
                    continue
            return None

        deadline = time.monotonic() + 120
        while (eng := engine()) is None:
            assert time.monotonic() < deadline, "no engine of the job started"
            time.sleep(0.5)
        found = environ_of(eng)
        assert b"OMP_NUM_THREADS=" in found  # it is the engine's environment
        assert b"RAY_AUTH" not in found and b"RAY_ADDRESS" not in found  # an allow-list: nothing of Ray's
        token = (tmp_path / "service" / "ray_token").read_bytes()
        # serve itself (re-executed without them: /proc shows the environment at exec), everything it started
        everything = [psutil.Process(serve.pid), eng, *psutil.Process(serve.pid).children(recursive=True)]
        assert any("NodeAgent" in " ".join(p.cmdline()) for p in everything if p.is_running())
        for p in everything:
            try:
                environ = environ_of(p)
                name = " ".join(p.cmdline())[:80]
            except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                continue
            for secret in (b"HORIZON_API_", b"sk-from-the-env-c41d", b"sk-from-the-file-9f3a", str(keys).encode(),
                           token):
                assert secret not in environ, f"{secret!r} in the environment of {name}"
        assert httpx.post(f"{url}/finetune/{job['id']}/cancel", headers=auth, timeout=60).status_code == 200
    finally:
        serve.send_signal(signal.SIGINT)  # serve stops the service and the cluster it started
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
