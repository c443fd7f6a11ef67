"""Fixtures the test modules share (instead of copies of helpers in each)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Ray must bind loopback on these machines; set before anything imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_cluster(tmp_path):
    """``fake_cluster(nodes, **kwargs)``: a coordinator over fake node agents (``cluster.fake.make_local_client``,
    its job table under this test's tmp_path), closed when the test ends, however it ends."""
    from horizon_ray.cluster.fake import make_local_client

    clients = []

    def make(nodes: dict, **kwargs):
        client = make_local_client(tmp_path / f"cluster-{len(clients)}", nodes, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture(scope="session")
def finetune():
    """``finetune(config, *args)``: `horizon-ray finetune --config <config> <args>` in a fresh process."""

    def run(config: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "horizon_ray", "finetune", "--config", str(config), *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)

    return run
