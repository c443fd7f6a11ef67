"""The coordinator core with in-process fake agents: state machine, placement, quotas, fairness, cancel,
failures, recovery and restart. No Ray, no engine."""

from __future__ import annotations

import io
import pickle

import pytest

from horizon_ray.cluster import (
    IdempotencyConflict,
    InvalidRequest,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    JobRecord,
    JobRejected,
    JobStatus,
    QuotaExceeded,
)
from horizon_ray.cluster.agent_protocol import ENGINE_LEASE_S
from horizon_ray.cluster.coordinator import Coordinator, default_validate_spec
from horizon_ray.cluster.errors import HorizonError
from horizon_ray.cluster.fake import FakeAgent, FakeStorage, size_planner
from horizon_ray.cluster.follow import format_event, should_submit_to_coordinator, submit_and_follow
from horizon_ray.cluster.messages import TERMINAL_STATES, TRANSITIONS, EventType, JobEvent, Launch, can_transition
from horizon_ray.cluster.tenants import TenantsConfig, fair_order, parse_bytes
from horizon_ray.errors import BadInput

GiB = 2**30


def spec(size: str = "10GiB", steps: int = 3, every: int = 0, **extra) -> dict:
    return {"model": {"path": f"/models/{size}"}, "data": {"path": "/data/train.jsonl"},
            "training": {"max_steps": steps}, "checkpoint": {"every_steps": every}, **extra}


@pytest.fixture
def client(fake_cluster):
    return fake_cluster({"a": "16GiB", "b": "64GiB", "c": "256GiB"}, auto=False,
                        tenants={"default": {"max_concurrent_jobs": 10}})


def agents(c):
    return c.coordinator.fake_agents


def launch_of(job, host_bytes=10 * GiB):
    return Launch(job_id=job.id, tenant=job.tenant, spec=job.spec, output_dir=job.output_dir, host_bytes=host_bytes,
                  gpu_bytes=0)


def statuses(c, tenant, ids):
    return [c.get(tenant, i).status for i in ids]


# ---- messages, errors, state machine -------------------------------------------------------------------


def test_terminal_states_cannot_be_left_and_every_live_state_can_end():
    for status in JobStatus:
        assert status.is_terminal() == (status in TERMINAL_STATES)
        if status.is_terminal():
            assert TRANSITIONS[status] == frozenset()
        else:
            assert TRANSITIONS[status] & {JobStatus.CANCELLED, JobStatus.CANCELLING}, status
            assert TRANSITIONS[status] & {JobStatus.FAILED, JobStatus.CANCELLED}, status
    assert not can_transition(JobStatus.SUCCEEDED, JobStatus.RUNNING)
    assert can_transition(JobStatus.RUNNING, JobStatus.RECOVERING)
    assert can_transition(JobStatus.RECOVERING, JobStatus.RUNNING)


def test_records_round_trip_and_errors_survive_the_wire(client):
    job = client.submit("acme", spec())
    again = JobRecord.from_dict(job.to_dict())
    assert again == job
    err = JobRejected("too big", reason="x", nodes=[{"node_id": "a"}])
    back = HorizonError.from_wire(err.to_wire())
    assert type(back) is JobRejected and back.message == "too big" and back.details["reason"] == "x"
    unpickled = pickle.loads(pickle.dumps(QuotaExceeded("over", limit="max_queued_jobs")))
    assert isinstance(unpickled, QuotaExceeded) and unpickled.details == {"limit": "max_queued_jobs"}


def test_tenants_file_loads_strictly(tmp_path):
    cfg = TenantsConfig.from_dict({"default": {"max_concurrent_jobs": 1},
                                   "tenants": {"acme": {"max_reserved_bytes": "32GiB"}}})
    assert cfg.quota("acme").max_reserved_bytes == 32 * GiB
    assert cfg.quota("acme").max_concurrent_jobs == 1  # inherits the default
    assert cfg.quota("other").max_concurrent_jobs == 1
    with pytest.raises(ValueError, match="unknown key"):
        TenantsConfig.from_dict({"default": {"max_jobs": 1}})
    with pytest.raises(ValueError, match="positive integer"):
        TenantsConfig.from_dict({"tenants": {"acme": {"max_concurrent_jobs": 0}}})
    assert parse_bytes("1.5 GiB") == int(1.5 * GiB) and parse_bytes("2TB") == 2 * 10**12
    path = tmp_path / "tenants.yaml"
    path.write_text("default:\n  max_concurrent_jobs: 3\n")
    assert TenantsConfig.load(path).default.max_concurrent_jobs == 3


# ---- placement and admission ---------------------------------------------------------------------------


def test_jobs_land_on_the_best_fitting_node(client):
    small = client.submit("acme", spec("10GiB"))
    medium = client.submit("acme", spec("40GiB"))
    large = client.submit("acme", spec("200GiB"))
    assert (small.node_id, medium.node_id, large.node_id) == ("a", "b", "c")
    assert all(j.status is JobStatus.RUNNING for j in (small, medium, large))
    # a has 6 GiB left, b 24 GiB, c 56 GiB: another 10 GiB job goes where the least is left over (b).
    other = client.submit("beta", spec("10GiB"))
    assert other.node_id == "b"
    ledger = {n.node_id: n.reserved_bytes for n in client.nodes()}
    assert ledger == {"a": 10 * GiB, "b": 50 * GiB, "c": 200 * GiB}
    assert small.plan["host_bytes"] == 10 * GiB


def test_oversized_job_is_rejected_with_the_reason_and_leaves_no_record(client):
    with pytest.raises(JobRejected) as info:
        client.submit("acme", spec("300GiB"))
    assert info.value.message.startswith("no node can ever hold this job: host RAM is the limit")
    assert "300.0 GiB" in info.value.message and "256.0 GiB" in info.value.message
    assert {n["node_id"] for n in info.value.details["nodes"]} == {"a", "b", "c"}
    assert client.list("acme") == ([], False)
    assert client.plan("acme", spec("300GiB"))["decision"] == "reject"


def test_a_job_only_gpu_memory_refuses_names_gpu_memory_as_the_limit(fake_cluster, capsys):
    """The headline names the binding limit: a 7B step that no GPU can hold is refused for GPU memory, not
    with the host RAM it needs next to a 512 GiB node; each node's reason comes as a list."""
    from horizon_ray.cluster.follow import format_refusal
    from horizon_ray.cluster.placement import default_planner

    client = fake_cluster({"a": "512GiB:1gpu@4GiB", "b": "256GiB:2gpu@6GiB"}, planner=default_planner)
    job = {"model": {"path": "qwen2.5-7b"}, "data": {"path": "/data/train.jsonl"}, "engine": {"device": "cuda"},
           "training": {"max_steps": 10, "seq_len": 1024, "micro_batch_size": 16}}
    with pytest.raises(JobRejected) as info:
        client.submit("acme", job)
    message = info.value.message
    assert message.startswith("no node can ever hold this job: GPU memory is the limit: it needs at least ")
    assert "of GPU memory and the most any node offers it is 6.0 GiB (node b)" in message
    assert "512.0 GiB" not in message and "host RAM would suffice" in message
    nodes = {n["node_id"]: n for n in info.value.details["nodes"]}
    assert nodes["a"]["short_of"] == ["GPU memory"] and "GPU memory needs" in nodes["a"]["reason"]
    lines = format_refusal(info.value).splitlines()
    assert lines[0] == f"error: {message}"
    assert [ln.split(":")[0] for ln in lines[1:]] == ["  node a", "  node b"]


def test_job_that_cannot_fit_now_waits_with_reason_and_position(client):
    big = client.submit("acme", spec("200GiB"))
    waiting = client.submit("acme", spec("100GiB"))
    behind = client.submit("acme", spec("1GiB"))
    assert big.status is JobStatus.RUNNING
    assert waiting.status is JobStatus.QUEUED and waiting.queue_position == 1
    assert "waiting for 100.0 GiB of free host RAM" in waiting.queue_reason
    assert "most free now: c with 56.0 GiB" in waiting.queue_reason
    # Within a tenant the order holds: a small job does not overtake the tenant's waiting job.
    assert behind.status is JobStatus.QUEUED and behind.queue_position == 2
    assert behind.queue_reason == f"behind job {waiting.id} of the same tenant"
    assert [j.id for j in client.queue("acme")] == [waiting.id, behind.id]
    plan = client.plan("acme", spec("100GiB"))
    assert plan["decision"] == "queue" and plan["node_id"] is None
    agents(client)["c"].advance(big.id, 3)
    assert statuses(client, "acme", [big.id, waiting.id, behind.id]) == [
        JobStatus.SUCCEEDED, JobStatus.RUNNING, JobStatus.RUNNING]
    assert client.get("acme", waiting.id).node_id == "c" and client.get("acme", behind.id).node_id == "a"


def test_invalid_spec_and_tenant_are_refused(client):
    with pytest.raises(InvalidSpec, match="model.path is required"):
        client.submit("acme", {"data": {"path": "/d.jsonl"}, "training": {"max_steps": 1}})
    with pytest.raises(InvalidSpec, match="unknown"):
        client.submit("acme", spec(bogus=1))
    with pytest.raises(InvalidRequest):
        client.submit("../etc", spec())
    with pytest.raises(InvalidRequest):
        client.list("acme", status="nope")


def test_tenants_see_only_their_jobs(client):
    job = client.submit("acme", spec())
    for call in (lambda: client.get("beta", job.id), lambda: client.cancel("beta", job.id),
                 lambda: client.events("beta", job.id), lambda: client.checkpoints("beta", job.id),
                 lambda: client.get("acme", "job-doesnotexist")):
        with pytest.raises(JobNotFound):
            call()
    assert client.list("beta") == ([], False)
    assert [j.id for j in client.list("acme")[0]] == [job.id]


def test_list_pages_newest_first(client):
    ids = [client.submit("acme", spec("1GiB")).id for _ in range(5)]
    page, more = client.list("acme", limit=2)
    assert [j.id for j in page] == ids[::-1][:2] and more
    page2, more2 = client.list("acme", limit=2, after=page[-1].id)
    assert [j.id for j in page2] == ids[::-1][2:4] and more2
    page3, more3 = client.list("acme", limit=2, after=page2[-1].id)
    assert [j.id for j in page3] == ids[:1] and not more3
    running, _ = client.list("acme", status="running")
    assert len(running) == 5


def test_idempotency_key_returns_the_same_job(client):
    first = client.submit("acme", spec(), idempotency_key="k1")
    assert client.submit("acme", spec(), idempotency_key="k1").id == first.id
    assert client.submit("beta", spec(), idempotency_key="k1").id != first.id  # keys are per tenant
    with pytest.raises(IdempotencyConflict):
        client.submit("acme", spec("2GiB"), idempotency_key="k1")


# ---- quotas and fairness ---------------------------------------------------------------------------------


def test_quotas_bound_concurrency_and_reserved_ram(fake_cluster):
    c = fake_cluster({"c": "256GiB"}, auto=False, tenants={
        "default": {"max_concurrent_jobs": 2, "max_reserved_bytes": "50GiB", "max_queued_jobs": 2}})
    a1, a2 = c.submit("acme", spec("10GiB")), c.submit("acme", spec("10GiB"))
    a3 = c.submit("acme", spec("10GiB"))
    assert [a1.status, a2.status, a3.status] == [JobStatus.RUNNING, JobStatus.RUNNING, JobStatus.QUEUED]
    assert a3.queue_reason == "tenant acme is at its quota of 2 concurrent jobs"
    b1 = c.submit("beta", spec("45GiB"))
    b2 = c.submit("beta", spec("10GiB"))
    assert b1.status is JobStatus.RUNNING and b2.status is JobStatus.QUEUED
    assert "would hold 55.0 GiB of host RAM; its quota is 50.0 GiB" in b2.queue_reason
    with pytest.raises(QuotaExceeded, match="quota is 50.0 GiB"):
        c.submit("beta", spec("60GiB"))
    c.submit("acme", spec("10GiB"))
    with pytest.raises(QuotaExceeded, match="2 jobs waiting"):
        c.submit("acme", spec("10GiB"))
    agents(c)["c"].advance(a1.id, 3)
    assert c.get("acme", a3.id).status is JobStatus.RUNNING


def test_burst_from_two_tenants_is_served_fairly(fake_cluster):
    # One node that holds one job at a time: the start order is the service order.
    c = fake_cluster({"n": "16GiB"}, auto=False)
    blocker = c.submit("zed", spec("10GiB"))
    a = [c.submit("acme", spec("10GiB", steps=1)) for _ in range(4)]
    b = [c.submit("beta", spec("10GiB", steps=1)) for _ in range(2)]
    q = c.queue()
    assert [j.tenant for j in q] == ["acme", "beta", "acme", "beta", "acme", "acme"]
    assert [j.queue_position for j in q] == [1, 2, 3, 4, 5, 6]
    node = agents(c)["n"]
    node.advance(blocker.id, 3)
    for _ in range(6):
        c.tick()
        running = [j for j in node.jobs.values() if j.exit is None]
        assert len(running) == 1
        node.advance(running[0].job_id, 1)
    c.tick()
    assert node.started[1:] == [a[0].id, b[0].id, a[1].id, b[1].id, a[2].id, a[3].id]


def test_priority_orders_jobs_within_a_tenant_only(fake_cluster):
    c = fake_cluster({"n": "16GiB"}, auto=False)
    c.submit("zed", spec("10GiB"))
    low = c.submit("acme", spec("10GiB"), priority=0)
    high = c.submit("acme", spec("10GiB"), priority=5)
    other = c.submit("beta", spec("10GiB"), priority=0)
    assert [j.id for j in c.queue()] == [high.id, other.id, low.id]


def test_fair_order_prefers_the_least_recently_served_tenant():
    def rec(i, tenant, status="queued"):
        return JobRecord(id=f"j{i}", tenant=tenant, name=None, status=JobStatus(status), priority=0,
                         created_at=float(i), spec={})

    jobs = [rec(0, "a"), rec(1, "a"), rec(2, "b"), rec(3, "c", "recovering")]
    assert [j.id for j in fair_order(jobs, {"a": 5, "b": 9})] == ["j3", "j0", "j2", "j1"]
    assert [j.id for j in fair_order(jobs, {"a": 9, "b": 5})] == ["j3", "j2", "j0", "j1"]


# ---- cancel -----------------------------------------------------------------------------------------------


def test_cancel_in_every_non_terminal_state_frees_the_reservation(fake_cluster):
    c = fake_cluster({"a": "16GiB", "b": "16GiB"}, auto=False)
    fa, fb = agents(c)["a"], agents(c)["b"]
    running = c.submit("acme", spec("10GiB", steps=100))
    checkpointing = c.submit("acme", spec("10GiB", steps=100))
    queued = c.submit("acme", spec("10GiB"))
    assert running.node_id == "a" and checkpointing.node_id == "b" and queued.status is JobStatus.QUEUED
    fb.set_checkpointing(checkpointing.id)
    c.tick()
    assert c.get("acme", checkpointing.id).status is JobStatus.CHECKPOINTING

    assert c.cancel("acme", queued.id).status is JobStatus.CANCELLED
    # LocalClient ticks after the cancel: the fake engine stops on its next poll.
    assert c.cancel("acme", running.id).status is JobStatus.CANCELLED
    assert c.cancel("acme", checkpointing.id).status is JobStatus.CANCELLED
    assert all(n.reserved_bytes == 0 and n.ledger == [] for n in c.nodes())
    assert fa.jobs == {} and fb.jobs == {}
    assert c.cancel("acme", queued.id).status is JobStatus.CANCELLED  # idempotent

    # cancelling: the engine has not stopped yet
    slow = c.submit("acme", spec("10GiB", steps=100))
    agent = agents(c)[slow.node_id]
    core = c.coordinator
    job = core.cancel("acme", slow.id)
    assert job.status is JobStatus.CANCELLING
    assert core.cancel("acme", slow.id).status is JobStatus.CANCELLING
    assert agent.ledger.reserved_bytes == 10 * GiB
    c.tick()
    assert c.get("acme", slow.id).status is JobStatus.CANCELLED and agent.ledger.reserved_bytes == 0

    # recovering: its node died, no other node has room
    r1 = c.submit("acme", spec("10GiB", steps=100))
    r2 = c.submit("beta", spec("10GiB", steps=100))
    dead = agents(c)[r1.node_id]
    dead.kill()
    c.tick()
    assert c.get("acme", r1.id).status is JobStatus.RECOVERING
    assert c.cancel("acme", r1.id).status is JobStatus.CANCELLED
    c.cancel("beta", r2.id)

    # succeeded and failed jobs cannot be cancelled
    done = c.submit("acme", spec("1GiB", steps=1))
    agents(c)[done.node_id].advance(done.id)
    c.tick()
    with pytest.raises(InvalidTransition):
        c.cancel("acme", done.id)
    statuses_seen = [e.data["to"] for e in c.events("acme", running.id) if e.type is EventType.STATUS]
    assert statuses_seen == ["validating", "queued", "running", "cancelling", "cancelled"]


def test_cancel_of_a_job_caught_validating_by_a_restart(tmp_path):
    store, jobs = tmp_path / "jobs.sqlite", tmp_path / "jobs"
    agents_ = {"a": FakeAgent("a", "16GiB", auto=False)}
    core = Coordinator(store_path=store, jobs_root=jobs, agents=agents_, planner=size_planner)
    core.tick()
    job = core.submit("acme", spec("10GiB"))
    core.cancel("acme", job.id)
    # A crash mid-submit leaves a VALIDATING row; cancel works there too.
    stuck = JobRecord.from_dict({**job.to_dict(), "id": "job-stuck000000", "status": "validating",
                                 "idempotency_key": None})
    core.store.put_job(stuck)
    assert core.get("acme", stuck.id).status is JobStatus.VALIDATING
    assert core.cancel("acme", stuck.id).status is JobStatus.CANCELLED
    core.close()


# ---- failures, recovery, restart --------------------------------------------------------------------


def test_a_spec_the_planner_cannot_plan_is_refused_and_leaves_nothing(client):
    unplannable = {**spec(), "model": {"path": "/nowhere/model"}}  # neither a directory nor a preset
    with pytest.raises(InvalidSpec, match="cannot plan the job: unknown model '/nowhere/model'"):
        client.submit("acme", unplannable, idempotency_key="k1")
    with pytest.raises(InvalidSpec, match="cannot plan the job"):
        client.plan("acme", unplannable)
    assert client.list("acme")[0] == [] and all(n.reserved_bytes == 0 for n in client.nodes())
    assert client.submit("acme", spec("10GiB"), idempotency_key="k1").status is JobStatus.RUNNING  # key free


def test_a_bf16_state_job_for_a_cpu_node_is_accepted_as_finetune_runs_it(fake_cluster):
    # compute_dtype auto with precision bf16-state: the runner computes in bfloat16 on a CPU, so the real
    # planner must plan that (it refused the spec as float32 compute, a job `finetune` runs)
    c = fake_cluster({"cpu": "64GiB"})
    job = c.submit("acme", {"model": {"path": "qwen2.5-0.5b"}, "data": {"path": "/data/train.jsonl"},
                            "training": {"max_steps": 3}, "engine": {"precision": "bf16-state"}})
    assert job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
    assert (job.plan["device"], job.plan["compute_dtype"], job.plan["mode"]) == ("cpu", "bfloat16", "bf16-state")


def test_jobs_queued_before_any_node_was_known_fail_alone_when_they_cannot_run(tmp_path):
    """Accepted while no node was known (just after a restart): one that no node can plan and one that no
    node can hold end FAILED with the reason once nodes report; other tenants' work and the same tenant's
    later jobs run."""
    agents_: dict = {}
    core = Coordinator(store_path=tmp_path / "jobs.sqlite", jobs_root=tmp_path / "jobs", agents=lambda: agents_,
                       planner=size_planner)
    unplannable = core.submit("acme", {**spec(), "model": {"path": "/nowhere/model"}})
    huge = core.submit("acme", spec("1TiB"))
    assert unplannable.status is huge.status is JobStatus.QUEUED
    agents_["a"] = FakeAgent("a", "16GiB", auto=False)
    other = core.submit("beta", spec("10GiB"))
    core.tick()
    failed = core.get("acme", unplannable.id)
    assert failed.status is JobStatus.FAILED and failed.error.code == "invalid_spec"
    assert "unknown model '/nowhere/model'" in failed.error.message
    rejected = core.get("acme", huge.id)
    assert rejected.status is JobStatus.FAILED and rejected.error.code == "rejected"
    assert core.get("beta", other.id).status is JobStatus.RUNNING
    later = core.submit("acme", spec("1GiB"))
    core.tick()
    assert core.get("acme", later.id).status is JobStatus.RUNNING
    core.close()


def test_an_agent_that_cannot_start_a_job_fails_that_job_only(client, monkeypatch):
    a = agents(client)["a"]
    real = a.start

    def start(launch):
        if launch.output_dir.endswith("unwritable"):
            raise PermissionError(13, "Permission denied", launch.output_dir)
        return real(launch)

    monkeypatch.setattr(a, "start", start)
    bad = client.submit("acme", {**spec("10GiB"), "output_dir": "/tmp/unwritable"})
    bad = client.get("acme", bad.id)
    assert bad.status is JobStatus.FAILED and bad.error.code == "start_failed"
    assert bad.error.message.startswith("node a could not start it: PermissionError") and "Permission denied" in \
        bad.error.message
    good = client.submit("beta", spec("10GiB"))
    assert good.status is JobStatus.RUNNING and good.node_id == "a"
    assert [n.reserved_bytes for n in client.nodes() if n.node_id == "a"] == [10 * GiB]


def test_an_engine_stopped_from_outside_resumes_after_a_pause(fake_cluster):
    """SIGTERM that no cancel sent (a node drain, a pod eviction), and exit 75 (an earlier engine of the job
    still held the output directory), are resumable: the job recovers from its checkpoint after a pause."""
    now = [1000.0]
    c = fake_cluster({"a": "16GiB"}, auto=False, clock=lambda: now[0])
    job = c.submit("acme", spec("10GiB", steps=6, every=2))
    agents(c)["a"].advance(job.id, 3)
    for code, message in ((143, "error: stopped by SIGTERM; rerun with --resume"),
                          (75, "error: another job is running in /x; wait for it or choose another output_dir")):
        agents(c)["a"].crash(job.id, code, message)
        c.tick()
        rec = c.get("acme", job.id)
        assert rec.status is JobStatus.RECOVERING and rec.error is None
        assert "retrying in 10 s" in rec.queue_reason and "resumes from checkpoint step 2" in rec.queue_reason
        now[0] += 11
        c.tick()
        rec = c.get("acme", job.id)
        assert rec.status is JobStatus.RUNNING and agents(c)["a"].jobs[job.id].step == 2
    assert rec.attempts == 3
    agents(c)["a"].advance(job.id, 4)
    assert c.get("acme", job.id).status is JobStatus.SUCCEEDED


def test_a_lost_cancel_is_sent_again_and_a_job_that_finished_first_succeeds(client, monkeypatch):
    core = client.coordinator
    job = client.submit("acme", spec("10GiB", steps=5))
    a = agents(client)[job.node_id]
    real, calls = a.cancel, []

    def flaky(job_id):
        calls.append(job_id)
        if len(calls) == 1:
            raise RuntimeError("connection reset by peer")
        real(job_id)

    monkeypatch.setattr(a, "cancel", flaky)
    assert core.cancel("acme", job.id).status is JobStatus.CANCELLING
    core.tick()  # sends it again
    core.tick()  # the engine stopped
    assert core.get("acme", job.id).status is JobStatus.CANCELLED and len(calls) == 2

    done = client.submit("acme", spec("10GiB", steps=2))
    b = agents(client)[done.node_id]
    monkeypatch.setattr(b, "cancel", lambda job_id: (_ for _ in ()).throw(RuntimeError("unreachable")))
    assert core.cancel("acme", done.id).status is JobStatus.CANCELLING
    b.advance(done.id, 2)  # it finished, final model written, before any cancel reached it
    core.tick()
    done = core.get("acme", done.id)
    assert done.status is JobStatus.SUCCEEDED
    assert [e.data.get("reason") for e in core.events("acme", done.id)][-1] == \
        "engine exited 0 before the cancel reached it"


def test_the_ram_quota_holds_on_the_node_the_job_lands_on(tmp_path):
    def planner(spec_, node):  # the plan differs by node (e.g. pinned staging on a GPU node)
        return {"host_bytes": (10 if node.node_id == "a" else 30) * GiB, "gpu_bytes": 0, "fits": True,
                "reason": "fits"}

    agents_ = {"a": FakeAgent("a", "100GiB", auto=False), "b": FakeAgent("b", "31GiB", auto=False)}
    core = Coordinator(store_path=tmp_path / "s.sqlite", jobs_root=tmp_path / "jobs", agents=agents_,
                       planner=planner, tenants=TenantsConfig.from_dict({"default": {"max_reserved_bytes": "20GiB"}}))
    core.tick()
    job = core.submit("acme", spec())
    core.tick()
    job = core.get("acme", job.id)
    # best fit alone would pick b (1 GiB left), whose plan (30 GiB) is over the tenant's 20 GiB
    assert job.status is JobStatus.RUNNING and job.node_id == "a" and job.plan["host_bytes"] == 10 * GiB
    core.close()


def test_an_engine_dying_mid_checkpoint_is_not_logged_as_checkpoint_written(client):
    job = client.submit("acme", spec("10GiB", steps=100))
    a = agents(client)[job.node_id]
    a.set_checkpointing(job.id)
    client.tick()
    assert client.get("acme", job.id).status is JobStatus.CHECKPOINTING
    a.oom(job.id)
    client.tick()
    reasons = [e.data.get("reason") for e in client.events("acme", job.id) if e.type is EventType.STATUS]
    assert "checkpoint written" not in reasons and client.get("acme", job.id).status is JobStatus.FAILED


def test_a_failed_begin_releases_the_store_lock(tmp_path):
    import sqlite3
    import threading

    from horizon_ray.cluster.store import JobStore

    store = JobStore(tmp_path / "jobs.sqlite")
    real_db = store._db

    class Locked:
        def execute(self, sql, *args):
            if sql == "BEGIN IMMEDIATE":
                raise sqlite3.OperationalError("database is locked")
            return real_db.execute(sql, *args)

    store._db = Locked()
    with pytest.raises(sqlite3.OperationalError), store.transaction():
        pass
    store._db = real_db
    other = threading.Thread(target=lambda: store.set_meta("k", 1))
    other.start()
    other.join(timeout=5)
    assert not other.is_alive() and store.get_meta("k", 0) == 1  # another thread is not locked out
    store.close()




def test_engine_crash_and_oom_fail_the_job_with_the_cause(client):
    crash = client.submit("acme", spec("10GiB", steps=100))
    oom = client.submit("acme", spec("40GiB", steps=100))
    bad = client.submit("acme", spec("100GiB", steps=100))
    agents(client)["a"].crash(crash.id, 1, "RuntimeError: CUDA error: an illegal memory access")
    agents(client)["b"].oom(oom.id, rss_bytes=60 * GiB)
    agents(client)["c"].crash(bad.id, 2, "error: model.path '/x' is not an HF model directory")
    crash, oom, bad = (client.get("acme", j.id) for j in (crash, oom, bad))
    assert crash.status is JobStatus.FAILED and crash.error.code == "engine_crashed"
    assert crash.error.message == ("engine exited with code 1: RuntimeError: CUDA error: an illegal memory "
                                   "access")
    assert oom.error.code == "oom_killed"
    assert oom.error.message == ("engine killed by SIGKILL, out of memory: it grew to 60.0 GiB, past the 40.0 GiB "
                                 "planned")
    assert bad.error.code == "bad_input"
    assert all(n.reserved_bytes == 0 for n in client.nodes())
    assert any(e.type is EventType.ERROR for e in client.events("acme", crash.id))


def test_progress_metrics_checkpoints_and_memory_are_recorded(client):
    job = client.submit("acme", spec("10GiB", steps=4, every=2))
    agents(client)["a"].advance(job.id, 3)
    job = client.get("acme", job.id)
    assert job.progress.step == 3 and job.progress.total_steps == 4 and job.progress.tokens_per_s == 1000.0
    assert job.metrics["loss"] == pytest.approx(1 / 3)
    assert job.last_checkpoint_step == 2
    assert [ck.step for ck in client.checkpoints("acme", job.id)] == [2]
    kinds = [e.type for e in client.events("acme", job.id)]
    assert kinds.count(EventType.METRICS) == 3 and EventType.MEMORY in kinds and EventType.CHECKPOINT in kinds
    seqs = [e.seq for e in client.events("acme", job.id)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert [e.seq for e in client.events("acme", job.id, after_seq=3)] == seqs[3:]


def test_checkpoints_the_runner_pruned_are_no_longer_listed(client):
    job = client.submit("acme", {**spec("10GiB", steps=5, every=1), "checkpoint": {"every_steps": 1, "keep": 2}})
    agents(client)["a"].advance(job.id, 4)
    assert [ck.step for ck in client.checkpoints("acme", job.id)] == [3, 4]


def test_node_loss_recovers_the_job_from_its_last_checkpoint_elsewhere(fake_cluster):
    c = fake_cluster({"small": "16GiB", "big": "64GiB"}, auto=False)
    job = c.submit("acme", spec("10GiB", steps=6, every=2))
    assert job.node_id == "small"
    agents(c)["small"].advance(job.id, 3)  # checkpoint at 2, then step 3 (lost with the node)
    c.tick()
    agents(c)["small"].kill()
    c.tick()
    job = c.get("acme", job.id)
    assert job.status is JobStatus.RUNNING and job.node_id == "big" and job.attempts == 2
    resumed = agents(c)["big"].jobs[job.id]
    assert resumed.step == 2  # from the last complete checkpoint
    agents(c)["big"].advance(job.id, 4)
    job = c.get("acme", job.id)
    assert job.status is JobStatus.SUCCEEDED and job.progress.step == 6
    moves = [(e.data["to"], e.data.get("reason")) for e in c.events("acme", job.id)
             if e.type is EventType.STATUS]
    assert moves[-3][0] == "recovering" and "node small was lost" in moves[-3][1]
    assert "resumes from checkpoint step 2" in moves[-3][1]
    assert moves[-2] == ("running", "resumed on node big from checkpoint step 2")
    assert {n.node_id: n.alive for n in c.nodes()} == {"big": True, "small": False}


def test_recovering_job_waits_with_reason_when_no_node_has_room(fake_cluster):
    c = fake_cluster({"a": "16GiB", "b": "16GiB"}, auto=False)
    j1 = c.submit("acme", spec("10GiB", steps=100))
    j2 = c.submit("beta", spec("10GiB", steps=100))
    queued = c.submit("acme", spec("10GiB"))
    agents(c)["a"].kill()
    c.tick()
    lost = j1 if j1.node_id == "a" else j2
    rec = c.get(lost.tenant, lost.id)
    assert rec.status is JobStatus.RECOVERING and rec.queue_position == 1
    assert "node a was lost" in rec.queue_reason
    # The recovering job comes before queued work when room appears.
    other = j2 if lost is j1 else j1
    agents(c)["b"].advance(other.id, 100)
    c.tick()
    assert c.get(lost.tenant, lost.id).status is JobStatus.RUNNING
    assert c.get("acme", queued.id).status is JobStatus.QUEUED


def test_agent_restart_loses_its_jobs_which_recover(client):
    job = client.submit("acme", spec("10GiB", steps=5))
    agents(client)["a"].restart()
    client.tick()
    job = client.get("acme", job.id)
    assert job.status is JobStatus.RUNNING and job.attempts == 2
    reasons = [e.data.get("reason") for e in client.events("acme", job.id)
               if e.data.get("to") == "recovering"]
    assert reasons and "agent of node a restarted" in reasons[0]


def test_coordinator_restart_loses_no_job_and_reattaches_running_ones(tmp_path):
    store, jobs = tmp_path / "jobs.sqlite", tmp_path / "jobs"
    storage = FakeStorage()
    fakes = {"a": FakeAgent("a", "16GiB", storage=storage, auto=False),
             "b": FakeAgent("b", "64GiB", storage=storage, auto=False)}

    def coordinator():
        core = Coordinator(store_path=store, jobs_root=jobs, agents=fakes, planner=size_planner)
        core.tick()
        return core

    first = coordinator()
    running = first.submit("acme", spec("10GiB", steps=5))
    first.tick()
    fakes["a"].advance(running.id, 2)
    first.tick()
    queued = first.submit("acme", spec("60GiB"))
    big = first.submit("beta", spec("50GiB", steps=5))
    first.tick()
    assert first.get("acme", queued.id).status is JobStatus.QUEUED
    seq_before = first.events("acme", running.id)[-1].seq
    first.close()  # the coordinator dies; the agents and their engines go on

    fakes["a"].advance(running.id, 1)
    second = coordinator()
    assert fakes["a"].started == [running.id]  # reattached, not restarted
    rec = second.get("acme", running.id)
    assert rec.status is JobStatus.RUNNING and rec.progress.step == 3 and rec.attempts == 1
    steps = [e.data["step"] for e in second.events("acme", running.id, after_seq=0)
             if e.type is EventType.METRICS]
    assert steps == [1, 2, 3]  # nothing lost or repeated across the restart
    assert second.events("acme", running.id)[-1].seq > seq_before
    assert second.get("acme", queued.id).status is JobStatus.QUEUED
    assert second.get("beta", big.id).status is JobStatus.RUNNING
    fakes["b"].advance(big.id, 5)
    second.tick()
    assert second.get("acme", queued.id).status is JobStatus.RUNNING
    second.close()


def test_restarted_coordinator_recovers_jobs_whose_engine_is_gone(tmp_path):
    store, jobs = tmp_path / "jobs.sqlite", tmp_path / "jobs"
    storage = FakeStorage()
    fakes = {"a": FakeAgent("a", "16GiB", storage=storage, auto=False)}
    first = Coordinator(store_path=store, jobs_root=jobs, agents=fakes, planner=size_planner)
    first.tick()
    job = first.submit("acme", spec("10GiB", steps=4, every=1))
    first.tick()
    fakes["a"].advance(job.id, 2)
    first.tick()
    first.close()
    fakes["a"].kill()
    fakes["b"] = FakeAgent("b", "16GiB", storage=storage, auto=False)
    del fakes["a"]
    clock = [1e12]
    second = Coordinator(store_path=store, jobs_root=jobs, agents=fakes, planner=size_planner,
                         clock=lambda: clock[0], node_dead_after_s=10)
    second.tick()
    assert second.get("acme", job.id).status is JobStatus.RUNNING  # grace period for node a
    clock[0] += 11
    second.tick()
    # Node a's agent heard from the first coordinator at the latest when this one started: it may run the job's
    # engine for up to its lease after that, so the job is not started elsewhere before.
    rec = second.get("acme", job.id)
    assert rec.status is JobStatus.RECOVERING and "retrying in" in rec.queue_reason
    clock[0] += ENGINE_LEASE_S
    second.tick()
    rec = second.get("acme", job.id)
    assert rec.status is JobStatus.RUNNING and rec.node_id == "b"
    assert fakes["b"].jobs[job.id].step == 2
    second.close()


def test_coordinator_adopts_a_job_started_just_before_it_crashed(tmp_path):
    store, jobs = tmp_path / "jobs.sqlite", tmp_path / "jobs"
    fakes = {"a": FakeAgent("a", "16GiB", auto=False)}
    core = Coordinator(store_path=store, jobs_root=jobs, agents=fakes, planner=size_planner)
    job = core.submit("acme", spec("10GiB"))  # no tick yet: the node is unknown, the job waits
    assert job.status is JobStatus.QUEUED
    fakes["a"].start(launch_of(job))  # started; the table never heard
    core.tick()
    rec = core.get("acme", job.id)
    assert rec.status is JobStatus.RUNNING and rec.node_id == "a" and fakes["a"].started == [job.id]
    core.close()


def test_stray_engine_of_a_finished_job_is_stopped(client):
    job = client.submit("acme", spec("10GiB", steps=10))
    client.cancel("acme", job.id)
    a = agents(client)["a"]
    a.start(launch_of(job))
    client.tick()
    assert job.id not in a.jobs and a.ledger.reserved_bytes == 0


# ---- submit_and_follow and the Ray Jobs hook -------------------------------------------------------------


def test_submit_and_follow_exits_zero_on_success_and_one_on_failure(fake_cluster):
    c = fake_cluster({"a": "16GiB"})
    out = io.StringIO()
    assert submit_and_follow(spec("1GiB", steps=2), tenant="acme", client=c, poll_s=0, out=out) == 0
    text = out.getvalue()
    assert "submitted job" in text and "queued -> running" in text and "succeeded" in text
    assert "step 2/2: loss 0.5000" in text
    assert submit_and_follow(spec("300GiB"), tenant="acme", client=c, poll_s=0, out=out) == 2

    c2 = fake_cluster({"a": "16GiB"}, auto=False)
    job_out = io.StringIO()

    class Crashing:
        def __getattr__(self, name):
            return getattr(c2, name)

        def events(self, tenant, job_id, after_seq=0):
            for j in list(c2.coordinator.fake_agents["a"].jobs):
                c2.coordinator.fake_agents["a"].crash(j, 1, "boom")
            return c2.events(tenant, job_id, after_seq)

    assert submit_and_follow(spec("1GiB"), tenant="acme", client=Crashing(), poll_s=0, out=job_out) == 1


def test_should_submit_to_coordinator_reads_the_environment():
    assert should_submit_to_coordinator({"HORIZON_RAY_SUBMIT": "1"})
    assert not should_submit_to_coordinator({"HORIZON_RAY_SUBMIT": "0", "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"})
    assert not should_submit_to_coordinator({})
    ev = JobEvent(seq=1, job_id="j", time=0.0, type=EventType.METRICS, data={"step": 3, "loss": 1.5})
    assert format_event(ev) == "[j] step 3: loss 1.5000"


def test_followers_read_progress_a_person_can_read():
    """A step's line says where the run is, how fast it goes and how long it has left; memory reads in GiB;
    a follower prints about one step in twenty (and the last), as the local progress does."""
    from horizon_ray.cluster.follow import _Throttle

    step = JobEvent(seq=1, job_id="j", time=0.0, type=EventType.METRICS, data={
        "step": 21, "total_steps": 400, "loss": 1.97472, "tokens_per_s": 7685.1, "eta_s": 3725.0})
    assert format_event(step) == "[j] step 21/400: loss 1.9747, 7,685 tokens/s, ETA 1:02:05"
    memory = JobEvent(seq=2, job_id="j", time=0.0, type=EventType.MEMORY, data={
        "rss_bytes": 3 * 2**30, "peak_rss_bytes": int(3.5 * 2**30), "planned_bytes": 4 * 2**30})
    assert format_event(memory) == "[j] host memory 3.0 GiB now, peak 3.5 GiB, 4.0 GiB planned"
    throttle = _Throttle()
    shown = [s for s in range(1, 101) if throttle.show(JobEvent(seq=s, job_id="j", time=0.0, type=EventType.METRICS,
                                                                 data={"step": s, "total_steps": 100, "loss": 1.0}))]
    assert shown == [1, *range(6, 101, 5), 100]
    assert throttle.show(memory) and throttle.show(JobEvent(seq=1, job_id="j", time=0.0, type=EventType.METRICS,
                                                            data={"step": 7, "eval_loss": 1.0}))


def test_status_tables_align_whatever_the_ids(fake_cluster, capsys, monkeypatch):
    from horizon_ray.cli import main
    from horizon_ray.commands import status

    c = fake_cluster({"a": "16GiB", "a-node-with-a-very-long-name-0123456789abcdef": "64GiB"}, auto=False)
    job = c.submit("acme", spec("40GiB", steps=100))
    c.coordinator.fake_agents["a-node-with-a-very-long-name-0123456789abcdef"].advance(job.id)
    c.coordinator.tick()
    monkeypatch.setattr(status, "connect", lambda args: (c, "acme"))
    assert main(["status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    nodes = lines[:3]
    assert [ln.index("RAM") if i == 0 else None for i, ln in enumerate(nodes)][0] == \
        len("a-node-with-a-very-long-name-0123456789abcdef") + 2
    starts = {ln.split()[0]: ln.index(ln.split()[1]) for ln in nodes}
    assert len(set(starts.values())) == 1  # the second column starts at one place on every row
    jobs = lines[lines.index("JOBS of tenant acme") + 1:]
    assert jobs[0].split() == ["ID", "STATUS", "NODE", "STEP", "TOKENS/S", "ETA", "CREATED", "NAME"]
    assert jobs[1].split()[:6] == [job.id, "running", "a-node-with-a-very-long-name-0123456789abcdef", "1/100",
                                   "1,000", "1:39"]
    assert jobs[1].index("running") == jobs[0].index("STATUS")


def test_default_spec_validation_uses_the_strict_job_spec():
    out = default_validate_spec({**spec(), "output_dir": "/tmp/x"})
    assert out["training"]["max_steps"] == 3 and out["engine"]["precision"] == "exact"
    with pytest.raises(ValueError):
        default_validate_spec({**spec(), "output_dir": "/tmp/x", "nope": 1})


def test_a_lora_spec_on_a_pre_quantized_checkpoint_records_the_checkpoints_quantize(tmp_path):
    """lora.quantize left out on a bitsandbytes checkpoint: the record says what trains (nf4), so REST, /v1's
    hyperparameters, the CLI and the dashboard show it; a conflicting value is refused at submit, naming both."""
    from tests.unit.test_engine_qlora_prequant import _saved_quantized

    qdir, _ = _saved_quantized(tmp_path, "nf4", True)
    lora_spec = {**spec(), "model": {"path": str(qdir)}, "method": "lora", "output_dir": "/tmp/x"}
    assert default_validate_spec(lora_spec)["lora"]["quantize"] == "nf4"
    with pytest.raises(BadInput, match="pre-quantized nf4 checkpoint"):
        default_validate_spec({**lora_spec, "lora": {"quantize": "int8"}})
    # a float checkpoint (or one this machine does not see) keeps the spec's own
    assert default_validate_spec({**spec(), "method": "lora", "output_dir": "/tmp/x"})["lora"]["quantize"] == "none"


def test_given_output_dir_is_kept_and_two_live_jobs_cannot_share_one(client, tmp_path):
    out = tmp_path / "mine"
    job = client.submit("acme", spec(output_dir=str(out)))
    assert job.output_dir == str(out) and job.spec["output_dir"] == str(out)
    with pytest.raises(InvalidSpec, match=f"output_dir of job {job.id}, which has not ended"):
        client.submit("acme", spec(output_dir=str(out)))
    with pytest.raises(InvalidSpec, match="output_dir of another job"):
        client.submit("beta", spec(output_dir=str(out)))
    # nested either way: the outer job's final/ or checkpoints/ pruning would delete the inner one's files
    for nested in (out / "final", tmp_path):
        with pytest.raises(InvalidSpec, match="is, holds or lies inside"):
            client.submit("acme", spec(output_dir=str(nested)))
    default = client.submit("acme", spec())
    assert default.output_dir.endswith(f"/jobs/acme/{default.id}")
    client.cancel("acme", job.id)
    again = client.submit("acme", spec(output_dir=str(out)))
    assert again.output_dir == str(out)
    client.cancel("acme", again.id)
    # a finished run there: a new job would only report it
    out.mkdir(parents=True, exist_ok=True)
    (out / "DONE").write_text("")
    with pytest.raises(InvalidSpec, match="holds a finished run"):
        client.submit("acme", spec(output_dir=str(out)))


@pytest.mark.parametrize("left", [".lease", "metrics.jsonl", "checkpoints", "final"])
def test_an_output_dir_holding_another_runs_outputs_is_refused(client, tmp_path, left):
    """A job is its own: an ended job's (or a local run's) lease, metrics or checkpoints would be replayed into
    the new job's events (its progress, its checkpoints) before it failed on a checkpoint of another spec."""
    out = tmp_path / "reused"
    out.mkdir()
    (out / left).mkdir() if left in ("checkpoints", "final") else (out / left).write_text("{}\n")
    with pytest.raises(InvalidSpec, match=f"holds another run's outputs \\({left}\\).*new output_dir"):
        client.submit("acme", spec(output_dir=str(out)))
    assert client.list("acme")[0] == []  # nothing was created
    (out / left).rmdir() if left in ("checkpoints", "final") else (out / left).unlink()
    (out / "notes.txt").write_text("")  # a directory of other files only is no run's
    assert client.submit("acme", spec(output_dir=str(out))).output_dir == str(out)


def test_simulated_nodes_parse_strictly():
    from horizon_ray.cluster.nodes import parse_simulated_nodes

    assert parse_simulated_nodes("a=16GiB, b=64GiB,c=256GiB") == {"a": 16 * GiB, "b": 64 * GiB, "c": 256 * GiB}
    for bad in ("a16GiB", "a=16GiB,a=1GiB", "a=lots", "", "a b=1GiB"):
        with pytest.raises(ValueError):
            parse_simulated_nodes(bad)


def test_serve_refuses_conflicting_flags():
    import argparse

    from horizon_ray.cli import main
    from horizon_ray.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(ValueError, match="drop --address"):
        serve.run(parser.parse_args(["--simulate-nodes", "a=1GiB", "--address", "auto"]))
    assert main(["serve", "--simulate-nodes", "a=nope"]) == 2


def test_a_diverged_loss_prints_as_nan():
    # metrics.jsonl writes a non-finite loss as null; following or showing such a job must not crash
    for key in ("loss", "eval_loss"):
        event = JobEvent(seq=1, job_id="j", time=0.0, type=EventType.METRICS, data={"step": 3, key: None})
        assert format_event(event).endswith(" nan")


def test_a_jobs_threads_are_pinned_across_attempts(fake_cluster):
    """Resume is bit-exact only with the same thread count (it decides the CPU kernels' reduction order): the
    agent gives a recovered job its first attempt's threads, not its share of a node that is busier now."""
    c = fake_cluster({"a": "16GiB:8cpu", "b": "64GiB:8cpu"}, auto=False)
    job = c.submit("acme", spec("10GiB", steps=6, every=2))
    assert job.node_id == "a"  # the smallest node that holds it
    threads = agents(c)["a"].ledger.entries[job.id].cpu_threads
    assert threads == 8 and c.get("acme", job.id).cpu_threads == 8  # alone on its node: every core
    busy = [c.submit("beta", spec("10GiB", steps=100)) for _ in range(3)]
    assert {j.node_id for j in busy} == {"b"}
    agents(c)["a"].advance(job.id, 2)
    c.tick()
    agents(c)["a"].kill()
    c.tick()
    job = c.get("acme", job.id)
    assert job.status is JobStatus.RUNNING and job.node_id == "b" and job.attempts == 2
    assert agents(c)["b"].ledger.cpu_share(False) == 1  # what a new job there would get now (8 cores, 5 jobs)
    assert agents(c)["b"].ledger.entries[job.id].cpu_threads == threads == job.cpu_threads
