"""The service on a local multi-node Ray cluster (ray.cluster_utils.Cluster), running the real engine.

Three simulated nodes declare 1, 2 and 4 GiB of RAM to the planner; jobs are the embedded tiny demo model
on a few dozen examples, run by the real `horizon-ray finetune` in the node agents' child processes.
Host bytes the planner gives these jobs on a CPU node: micro-batch 2 x 64 tokens -> 541 MiB (fits every
node), 64 x 512 -> 1.2 GiB (b or c), 64 x 2048 -> 2.6 GiB (c only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.passes import after_a_pass

pytestmark = pytest.mark.integration

GiB, MiB = 2**30, 2**20
RAM = {"a": 1 * GiB, "b": 2 * GiB, "c": 4 * GiB}
TENANTS = """
default:
  max_concurrent_jobs: 4
tenants:
  quota-one: {max_concurrent_jobs: 1}
  small-quota: {max_reserved_bytes: 2GiB}
"""
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from horizon_ray.job.demo import prepare_demo_assets

    home = tmp_path_factory.mktemp("assets")
    demo, _ = prepare_demo_assets(home)
    lines = demo.train_path.read_text().splitlines(keepends=True)
    small = home / "train-small.jsonl"
    small.write_text("".join(lines[:64]))
    return {"model": str(demo.model_dir), "small": str(small), "full": str(demo.train_path),
            "wide": str(wide_model(demo.model_dir, home / "wide"))}


def wide_model(demo_dir: Path, out: Path) -> Path:
    """A one-layer model with a 700k-entry vocabulary: 90M parameters (2.2 GiB planned on a CPU node)
    but little compute per token. The demo tokenizer only uses the first 262 ids."""
    import shutil

    from horizon_ray.engine import Engine, EngineConfig
    from horizon_ray.job.demo import DEMO_MODEL_CONFIG

    config = dict(DEMO_MODEL_CONFIG, vocab_size=700_000, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    eng = Engine.from_config(config, EngineConfig(device="cpu", seed=0))
    try:
        eng.save_pretrained(out)
    finally:
        eng.close()
    for f in demo_dir.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def service(tmp_path_factory, assets):
    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.local import simulated_service

    root = tmp_path_factory.mktemp("service")
    tenants = root / "tenants.yaml"
    tenants.write_text(TENANTS)
    # a short engine lease: a lost node's jobs start elsewhere once it has passed (the default is a minute)
    with simulated_service(root, RAM, tenants_file=tenants, node_dead_after_s=5, engine_lease_s=8,
                           agent_env={"OMP_NUM_THREADS": "1"}) as (cluster, svc):
        yield {"cluster": cluster, "client": RayClient(), "root": root, "svc": svc, "address": cluster.address}


def spec(assets, *, steps=3, mb=2, seq=64, every=0, data="small", model="model", **extra):
    return {
        "model": {"path": assets[model]},
        "data": {"path": assets[data], "format": "messages", "eval_fraction": 0.0},
        "training": {"max_steps": steps, "micro_batch_size": mb, "seq_len": seq, "lr": 1e-3,
                     "schedule": {"type": "constant"}},
        "checkpoint": {"every_steps": every, "keep": 2},
        "engine": {"device": "cpu"},
        **extra,
    }


def wait_for(predicate, timeout=120.0, what="condition"):
    from horizon_ray.cluster.local import wait_for as _wait

    return _wait(predicate, timeout, what=what)


def wait_status(client, tenant, job_id, statuses, timeout=180.0):
    statuses = {statuses} if isinstance(statuses, str) else set(statuses)

    def check():
        job = client.get(tenant, job_id)
        if job.status.value not in statuses and job.status.is_terminal():
            raise AssertionError(f"{job_id} ended {job.status.value}: {job.error}")
        return job if job.status.value in statuses else None

    return wait_for(check, timeout, what=f"{job_id} to reach {sorted(statuses)}")


def reserved(client):
    return {n.node_id: n.reserved_bytes for n in client.nodes() if n.alive}


def test_best_fit_placement_rejection_and_cancel_frees_reservations(service, assets):
    from horizon_ray.cluster import JobRejected

    c = service["client"]
    small = c.submit("place", spec(assets, steps=4))
    medium = c.submit("place", spec(assets, steps=1000, mb=64, seq=512, data="full"))
    large = c.submit("place", spec(assets, steps=1000, mb=64, seq=2048, data="full"))
    small2 = c.submit("place", spec(assets, steps=4))
    small, medium, large, small2 = after_a_pass(c, small, medium, large, small2)
    # Each job goes where the least RAM is left over: small -> a (1 GiB); medium -> b (2 GiB; c would
    # keep 2.8 GiB idle); large -> c, the only node it fits; the second small one no longer fits a and
    # goes to b (2 GiB - 1.2 GiB leaves 0.8 GiB) rather than c (1.4 GiB left).
    assert [j.node_id for j in (small, medium, large, small2)] == ["a", "b", "c", "b"]
    assert all(j.status.value == "running" for j in (small, large, medium, small2))
    host = {j.id: j.plan["host_bytes"] for j in (small, large, medium, small2)}
    assert host[small.id] < 0.95 * GiB < host[medium.id] < 1.9 * GiB < host[large.id] < 3.8 * GiB
    assert reserved(c) == {"a": host[small.id], "b": host[medium.id] + host[small2.id], "c": host[large.id]}

    with pytest.raises(JobRejected) as info:
        c.submit("place", spec(assets, mb=64, seq=8192, data="full"))
    assert "no node can ever hold this job" in info.value.message
    assert "largest node, c, has 4.0 GiB" in info.value.message
    assert len(c.list("place")[0]) == 4

    for job in (medium, large):
        assert c.cancel("place", job.id).status.value in ("cancelling", "cancelled")
    for job in (medium, large):
        done = wait_status(c, "place", job.id, "cancelled", timeout=60)
        assert done.finished_at is not None
    for job in (small, small2):
        done = wait_status(c, "place", job.id, "succeeded")
        assert done.progress.step == 4 and Path(done.output_dir, "final", "config.json").is_file()
    wait_for(lambda: set(reserved(c).values()) == {0}, 30, what="the ledgers to empty")


def test_burst_from_two_tenants_is_served_fairly_within_quotas(service, assets):
    from horizon_ray.cluster import QuotaExceeded

    c = service["client"]
    # The wide model (2.2 GiB planned) fits only c, one job at a time: c is the contended resource.
    a = [c.submit("fair-a", spec(assets, steps=1, mb=1, seq=16, model="wide")) for _ in range(2)]
    extra = c.submit("fair-a", spec(assets, steps=1, mb=1, seq=16, model="wide"))
    b = [c.submit("fair-b", spec(assets, steps=1, mb=1, seq=16, model="wide")) for _ in range(2)]
    *a, extra = after_a_pass(c, *a, extra)
    b = after_a_pass(c, *b)
    assert a[0].node_id == "c" and all(j.status.value == "queued" for j in [a[1], extra, *b])
    assert a[1].queue_reason.startswith("waiting for 2.") and "most free now: c with 1." in a[1].queue_reason
    # fair-b has not been served yet: its first job goes before the rest of fair-a's burst.
    assert [j.id for j in c.queue()] == [b[0].id, a[1].id, b[1].id, extra.id]
    assert c.cancel("fair-a", extra.id).status.value == "cancelled"  # cancel while queued
    with pytest.raises(QuotaExceeded, match="quota is 2.0 GiB"):
        c.submit("small-quota", spec(assets, steps=1, mb=1, seq=16, model="wide"))

    jobs = [wait_status(c, j.tenant, j.id, "succeeded") for j in a + b]
    by_start = sorted(jobs, key=lambda j: j.started_at)
    assert [j.id for j in by_start] == [a[0].id, b[0].id, a[1].id, b[1].id]
    for before, after in zip(by_start, by_start[1:]):
        assert before.finished_at <= after.started_at, "c ran two jobs at once"
    assert c.get("fair-a", extra.id).attempts == 0


def test_cli_submit_follow_and_status(service, assets, tmp_path):
    import yaml

    # a coordinator started without a gate (this module's) takes the CLI without a key as tenant default
    env = {**os.environ, "HORIZON_RAY_ADDRESS": service["address"]}
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(spec(assets, steps=2, name="from-cli")))
    cli = [sys.executable, "-m", "horizon_ray"]
    out = subprocess.run([*cli, "submit", str(job_yaml), "--follow"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "queued -> running" in out.stdout and "succeeded" in out.stdout
    job_id = out.stdout.split()[0]
    status = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert status.returncode == 0, status.stderr
    assert job_id in status.stdout and "from-cli" in status.stdout
    assert all(f"\n{n} " in status.stdout for n in RAM)
    one = subprocess.run([*cli, "status", job_id], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert one.returncode == 0 and "succeeded" in one.stdout and "step: 2/2" in one.stdout

    # A job whose engine refuses to start fails, and both CLIs exit non-zero.
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec(assets, steps=2) | {"data": {"path": str(tmp_path / "none.jsonl")}}))
    out = subprocess.run([*cli, "submit", str(bad), "-f"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 1 and "failed" in out.stderr
    bad_id = out.stdout.split()[0]
    one = subprocess.run([*cli, "status", bad_id], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert one.returncode == 1 and "bad_input" in one.stdout


def test_node_removed_mid_job_resumes_elsewhere_with_the_same_final_weights(service, assets, tmp_path):
    import yaml

    from horizon_ray.cluster.local import add_simulated_node

    c, cluster = service["client"], service["cluster"]
    # x declares 0.75 GiB: the tightest fit for a small job, so the job lands there.
    x = add_simulated_node(cluster, "x")
    from horizon_ray.cluster.ray_actors import ensure_agents

    ensure_agents({**RAM, "x": 768 * MiB}, env={"OMP_NUM_THREADS": "1"}, only_simulated=True, engine_lease_s=8)
    wait_for(lambda: any(n.node_id == "x" and n.alive for n in c.nodes()), 60, what="node x")

    job_spec = spec(assets, steps=24, every=3, data="full", mb=4, seq=64)
    # The reference: the same spec, uninterrupted, by the same command the agents run.
    ref = {**job_spec, "output_dir": str(tmp_path / "reference")}
    (tmp_path / "ref.yaml").write_text(yaml.safe_dump(ref))
    reference = subprocess.Popen([sys.executable, "-m", "horizon_ray", "finetune", "--config",
                                  str(tmp_path / "ref.yaml"), "--no-progress"], cwd=ROOT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "HORIZON_RAY_SUBMIT": "0"},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        job = after_a_pass(c, c.submit("move", job_spec))
        assert job.node_id == "x"
        wait_for(lambda: (c.get("move", job.id).last_checkpoint_step or 0) >= 3, 180,
                 what="the first checkpoint")
        before = c.get("move", job.id)
        assert before.status.value in ("running", "checkpointing") and before.progress.step < 24
        cluster.remove_node(x, allow_graceful=False)

        moved = wait_for(lambda: (j := c.get("move", job.id)).attempts == 2 and j.status.value == "running"
                         and j, 120, what="the job to resume")
        engines = [p for p in psutil.process_iter(["cmdline"])
                   if f"{moved.output_dir}/job.yaml" in " ".join(p.info["cmdline"] or [])]
        assert len(engines) == 1, "the engine on the removed node outlived it"
        done = wait_status(c, "move", job.id, "succeeded", timeout=300)
        assert reference.wait(timeout=300) == 0, reference.stderr.read()
    finally:
        if reference.poll() is None:
            reference.kill()
    assert done.node_id != "x" and done.attempts == 2
    moves = [e.data for e in c.events("move", done.id) if e.type.value == "status"]
    recovering = next(m for m in moves if m["to"] == "recovering")
    assert "node x was lost" in recovering["reason"]
    resumed = moves[moves.index(recovering) + 1]
    assert resumed["to"] == "running" and "from checkpoint step" in resumed["reason"]
    assert not any(n.alive for n in c.nodes() if n.node_id == "x")
    assert_same_weights(Path(done.output_dir) / "final", tmp_path / "reference" / "final")


def assert_same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    def load(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    wa, wb = load(a), load(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert wa[name].equal(wb[name]), f"{name} differs after the recovered run"


def test_coordinator_killed_and_restarted_loses_no_job(service, assets):
    import ray

    from horizon_ray.cluster import CoordinatorUnavailable
    from horizon_ray.cluster.client import COORDINATOR_NAME, NAMESPACE

    c = service["client"]
    before_ids = {t: {j.id for j in c.list(t, limit=100)[0]} for t in ("place", "fair-a", "fair-b", "default")}
    running = c.submit("restart", spec(assets, steps=16, data="full", every=4))
    blocked = after_a_pass(c, *[c.submit("quota-one", spec(assets, steps=steps)) for steps in (8, 1)])
    assert blocked[1].status.value == "queued"
    assert blocked[1].queue_reason == "tenant quota-one is at its quota of 1 concurrent jobs"
    wait_for(lambda: c.get("restart", running.id).progress.step >= 2, 120, what="progress")

    actor = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
    pid = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)  # a crash: Ray restarts it (max_restarts=-1) from its job table

    def answers():
        try:
            return c.ready() and c.get("restart", running.id)
        except CoordinatorUnavailable:
            return None

    wait_for(answers, 120, what="the restarted coordinator")

    def new_pid():
        # a handle taken before the kill may still report the restart as "temporarily unavailable"
        try:
            return ray.get(ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE).pid.remote(), timeout=30)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            return None

    assert wait_for(new_pid, 60, what="the restarted coordinator's pid") != pid
    job = wait_status(c, "restart", running.id, "succeeded")
    assert job.attempts == 1, "the running job should have been reattached, not restarted"
    steps = [e.data["step"] for e in c.events("restart", job.id) if e.type.value == "metrics"]
    assert steps == list(range(1, 17)), "metrics were lost or repeated across the restart"
    for j in blocked:
        wait_status(c, "quota-one", j.id, "succeeded")
    after_ids = {t: {j.id for j in c.list(t, limit=100)[0]} for t in before_ids}
    assert all(before_ids[t] <= after_ids[t] for t in before_ids)
