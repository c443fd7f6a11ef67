"""The job's lease on its output directory (horizon_ray.job.lease): who may write there, and the real runner
stopping, without writing anything more, once its start is superseded or revoked."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from horizon_ray import exit_codes
from horizon_ray.job import lease
from horizon_ray.job.lease import Fence, Fenced, LeaseLost

ROOT = Path(__file__).resolve().parents[2]


def test_a_start_writes_only_while_the_lease_is_its_own(tmp_path):
    out = tmp_path / "out"
    lease.grant(out, "job-1", 1, "a")
    first = Fence(out, "job-1", 1)
    first.check("step 1")
    lease.grant(out, "job-1", 2, "b")  # recovered elsewhere while the first was cut off
    with pytest.raises(Fenced, match="start 2 of the job took over"):
        first.check("step 2")
    Fence(out, "job-1", 2).check("step 1")
    with pytest.raises(LeaseLost):  # a stale start (a retried call of the first placement) cannot take it back
        lease.grant(out, "job-1", 1, "a")
    assert lease.revoke(out, "job-1", epoch=1) is None  # revoking an older start leaves the newer one be
    assert lease.revoke(out, "job-1").revoked
    with pytest.raises(Fenced, match="revoked"):
        Fence(out, "job-1", 2).check("step 2")
    with pytest.raises(LeaseLost):
        lease.grant(out, "job-1", 2, "b")
    lease.grant(out, "job-1", 3, "c")  # the next start after a revocation (its node was lost) may
    with pytest.raises(Fenced, match="gone or another job's"):
        Fence(out, "job-0", 3).check("step 1")
    assert lease.read_lease(out) == lease.Lease.decode(lease.read_lease(out).encode())


def test_a_revocation_waits_for_the_write_in_flight_and_none_starts_after(tmp_path):
    out = tmp_path / "out"
    lease.grant(out, "job-1", 1)
    fence = Fence(out, "job-1", 1)
    inside, done = threading.Event(), []

    def write():
        with fence.guard("writing a metrics line"):
            inside.set()
            time.sleep(0.5)
            done.append(time.monotonic())

    writer = threading.Thread(target=write)
    writer.start()
    assert inside.wait(10)
    lease.revoke(out, "job-1")
    returned = time.monotonic()
    writer.join(10)
    assert done and done[0] <= returned, "revoke returned while a guarded write was still in flight"
    with pytest.raises(Fenced), fence.guard("writing another line"):
        pass


def test_an_engine_started_by_hand_has_no_fence(tmp_path):
    assert Fence.from_env(tmp_path, {}) is None
    assert Fence.from_env(tmp_path, {lease.ENV_EPOCH: "2", lease.ENV_JOB: "job-1"}).epoch == 2


# ---- the real runner --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from horizon_ray.job.demo import prepare_demo_assets

    assets, _ = prepare_demo_assets(tmp_path_factory.mktemp("assets"))
    return assets


def outputs(out: Path) -> dict[str, tuple[int, int]]:
    """What the engine has committed under `out`: every file but the lease's own and those of a write still in a
    temporary (a checkpoint being written when the lease moved on is finished there, never renamed into place,
    and removed): (size, mtime in ns)."""
    found = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).parts
        if p.is_file() and p.name not in (lease.LEASE_FILE, lease.LOCK_FILE) and "logs" not in rel and \
                not any(".tmp" in part for part in rel):
            st = p.stat()
            found[str(p.relative_to(out))] = (st.st_size, st.st_mtime_ns)
    return found


def run_engine(demo, out: Path, epoch: int) -> subprocess.Popen:
    spec = {"model": {"path": str(demo.model_dir)},
            "data": {"path": str(demo.train_path), "format": "messages", "eval_fraction": 0.0},
            "training": {"max_steps": 100000, "micro_batch_size": 2, "seq_len": 32, "lr": 1e-3,
                         "schedule": {"type": "constant"}},
            "checkpoint": {"every_steps": 2, "keep": 2}, "engine": {"device": "cpu"}, "output_dir": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, lease.ENV_JOB: "job-1", lease.ENV_EPOCH: str(epoch), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "horizon_ray.job", "--config", str(out / "job.yaml"), "--resume"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 180
    while not list((out / "checkpoints").glob("step-*/COMPLETE")):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["superseded", "revoked"])
def test_a_stale_engine_stops_and_writes_nothing_more(demo, tmp_path, how):
    out = tmp_path / "out"
    lease.grant(out, "job-1", 1, "a")
    proc = run_engine(demo, out, epoch=1)
    try:
        wait_for_checkpoint(proc, out)
        if how == "superseded":
            lease.grant(out, "job-1", 2, "b")  # the job was recovered on another node
        else:
            lease.revoke(out, "job-1")  # the job was cancelled
        after = outputs(out)  # when grant/revoke returns, no write of the stale engine is in flight
        rc = proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == exit_codes.FENCED, err
    assert ("took over" if how == "superseded" else "revoked") in err
    assert outputs(out) == after, "the engine wrote after its lease moved on"
    assert "error" not in (out / "metrics.jsonl").read_text().splitlines()[-1]  # not even why it stopped
