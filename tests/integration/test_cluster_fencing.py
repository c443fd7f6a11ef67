"""Fencing on a local multi-node Ray cluster (ray.cluster_utils.Cluster), with the real engine.

Losing a node by killing its raylet leaves its agent alive, re-parented, and its engine training: the probe
that found this saw every recovered start fail on the output directory the old engine still held (attempts 2
to 6), and the old engine keep writing checkpoints after the job was cancelled. Here the old engine stops
(its lease is revoked when the node is declared lost, and its agent, cut off, stops it after its own lease),
the job resumes once, from its last checkpoint, and a cancel leaves nothing writing. A kill -9 of an engine
below its plan, on a node with free memory, is a crash the job resumes from, not an OOM.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.passes import after_a_pass

pytestmark = pytest.mark.integration

GiB, MiB = 2**30, 2**20
# The demo job plans 541 MiB on a CPU node: x, the tighter fit, gets it first.
RAM = {"x": 768 * MiB, "y": 2 * GiB}
LEASE_S, DEAD_AFTER_S = 4.0, 3.0


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from horizon_ray.job.demo import prepare_demo_assets

    demo, _ = prepare_demo_assets(tmp_path_factory.mktemp("assets"))
    return demo


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.local import simulated_service

    root = tmp_path_factory.mktemp("fencing")
    with simulated_service(root, RAM, node_dead_after_s=DEAD_AFTER_S, engine_lease_s=LEASE_S,
                           agent_env={"OMP_NUM_THREADS": "1"}) as (cluster, svc):
        yield {"cluster": cluster, "client": RayClient()}


def spec(demo, steps: int, every: int = 3) -> dict:
    return {"model": {"path": str(demo.model_dir)},
            "data": {"path": str(demo.train_path), "format": "messages", "eval_fraction": 0.0},
            "training": {"max_steps": steps, "micro_batch_size": 2, "seq_len": 64, "lr": 1e-3,
                         "schedule": {"type": "constant"}},
            "checkpoint": {"every_steps": every, "keep": 2}, "engine": {"device": "cpu"}}


def wait_for(predicate, timeout: float, what: str):
    from horizon_ray.cluster.local import wait_for as _wait

    return _wait(predicate, timeout, what=what)


def engines_of(output_dir: str) -> list[psutil.Process]:
    """The live engine processes of a job (its spec path is on their command line)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if f"{output_dir}/job.yaml" in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def outputs(out: Path) -> dict[str, tuple[int, int]]:
    """What the job has committed: every file under its output directory but the lease's, the processes' logs and
    a write still in a temporary (a checkpoint being written at the cancel is never renamed into place)."""
    found = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).parts
        if p.is_file() and not p.name.startswith(".lease") and "logs" not in rel and \
                not any(".tmp" in part for part in rel):
            st = p.stat()
            found[str(p.relative_to(out))] = (st.st_size, st.st_mtime_ns)
    return found


def moves(client, tenant, job_id):
    return [e.data for e in client.events(tenant, job_id) if e.type.value == "status"]


def test_a_lost_nodes_engine_stops_the_job_resumes_once_and_a_cancel_stops_everything(service, assets):
    c, cluster = service["client"], service["cluster"]
    job = after_a_pass(c, c.submit("fence", spec(assets, steps=100_000)))
    assert job.node_id == "x"
    wait_for(lambda: (c.get("fence", job.id).last_checkpoint_step or 0) >= 3, 180, "the first checkpoint")
    [old] = engines_of(job.output_dir)
    agent = old.parent()
    x = next(n for n in c.nodes() if n.node_id == "x").ray_node_id
    node = next(n for n in cluster.worker_nodes if n.node_id == x)
    raylet = node.all_processes["raylet"][0].process
    try:
        os.kill(raylet.pid, signal.SIGKILL)  # the node is lost; its agent lives on, re-parented
        lost = time.monotonic()
        wait_for(lambda: gone(old), 120, "the lost node's engine to stop")
        stopped_after = time.monotonic() - lost
        assert agent.is_running(), "the agent died with its raylet: this test would not test the lease"

        moved = wait_for(lambda: (j := c.get("fence", job.id)).status.value == "running" and j.attempts == 2 and j,
                         180, "the job to resume")
        assert moved.node_id == "y"
        wait_for(lambda: c.get("fence", job.id).progress.step > moved.last_checkpoint_step + 2, 120,
                 "the resumed engine to train")
        [new] = engines_of(job.output_dir)
        assert new.pid != old.pid

        # resumed once, from its last checkpoint: no start failed on a directory the old engine still held
        log = moves(c, "fence", job.id)
        recovering = [m for m in log if m["to"] == "recovering"]
        assert len(recovering) == 1 and "node x was lost" in recovering[0]["reason"], log
        resumed = log[log.index(recovering[0]) + 1]
        assert resumed["to"] == "running" and "from checkpoint step" in resumed["reason"], log
        assert c.get("fence", job.id).attempts == 2
        print(f"the lost node's engine stopped {stopped_after:.1f} s after its raylet was killed")

        # a cancel: when it returns, nothing of the job writes any more, and every engine of it ends
        assert c.cancel("fence", job.id).status.value in ("cancelling", "cancelled")
        written = outputs(Path(job.output_dir))
        wait_for(lambda: c.get("fence", job.id).status.value == "cancelled", 60, "the cancel")
        wait_for(lambda: not engines_of(job.output_dir), 60, "every engine of the job to exit")
        time.sleep(2.0)  # several steps' time of the tiny model
        assert outputs(Path(job.output_dir)) == written, "an engine of the job wrote after the cancel returned"
    finally:
        for p in (old, agent):  # the re-parented agent of the lost node is this test's to clean up
            if not gone(p):
                p.kill()


def test_a_killed_engine_below_its_plan_is_not_an_oom_and_resumes(service, assets):
    c = service["client"]
    job = c.submit("crash", spec(assets, steps=30))
    wait_for(lambda: (c.get("crash", job.id).last_checkpoint_step or 0) >= 3, 180, "the first checkpoint")
    [engine] = engines_of(job.output_dir)
    engine.kill()  # kill -9, far below its plan, on a machine with free memory
    done = wait_for(lambda: (j := c.get("crash", job.id)).status.is_terminal() and j, 300, "the job to end")
    assert done.status.value == "succeeded", done.error
    assert done.attempts == 2 and done.progress.step == 30
    log = moves(c, "crash", job.id)
    [recovering] = [m for m in log if m["to"] == "recovering"]
    assert "killed by SIGKILL with no sign of memory pressure" in recovering["reason"], recovering
    assert "from checkpoint step" in log[log.index(recovering) + 1]["reason"]
