"""The tenants' API keys stay in the API process's memory: `horizon-ray serve` started with HORIZON_API_KEYS and
HORIZON_API_KEYS_FILE in its environment runs a real job, and neither serve's own exec environment (it
re-executes itself without them), the Ray processes it starts (GCS, raylets, workers, the node agents) nor the
job's engine has any HORIZON_API_* variable, a key, the key file's path or Ray's token, read from their
/proc/<pid>/environ; the engine has no RAY_* variable at all."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.serving import free_port, serving

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def environ_of(proc: psutil.Process) -> bytes:
    return Path(f"/proc/{proc.pid}/environ").read_bytes()


def _cmdline(proc: psutil.Process) -> str:
    """Its command line, or "" for one that exited meanwhile (Ray starts and ends idle workers all the time)."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, ProcessLookupError):
        return ""


def test_engines_and_ray_workers_get_no_api_secret(tmp_path):
    from horizon_ray.job.demo import prepare_demo_assets

    demo, _ = prepare_demo_assets(tmp_path / "assets")
    assets = demo.model_dir.parent
    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-from-the-file-9f3a: globex\n")
    env = {**os.environ, "HORIZON_API_KEYS": "sk-from-the-env-c41d=acme", "HORIZON_API_KEYS_FILE": str(keys),
           "HORIZON_MODEL_ROOTS": str(assets), "HORIZON_DATA_ROOTS": str(assets),
           "HORIZON_UPLOADS_DIR": str(tmp_path / "uploads"), "OMP_NUM_THREADS": "1",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    auth = {"Authorization": "Bearer sk-from-the-env-c41d"}
    # the API on a port the OS picks (--port 0, read back from serve's log); Ray's dashboard takes no 0
    argv = [sys.executable, "-m", "horizon_ray", "serve", "--simulate-nodes", "a=2GiB", "--root",
            str(tmp_path / "service"), "--port", "0", "--dashboard-port", str(free_port())]
    with serving(argv, env, tmp_path / "serve.log", cwd=ROOT, timeout_s=240) as served:
        serve, url = served.proc, served.url
        deadline = time.monotonic() + 60
        while (ready := httpx.get(f"{url}/readyz", timeout=5)).status_code != 200:
            assert time.monotonic() < deadline, f"serve not ready within 60 s: {ready.text}"
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
        assert any("NodeAgent" in _cmdline(p) for p in everything)
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
