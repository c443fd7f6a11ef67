"""The coordinator's side of fencing and retries, over fake agents and a fake clock: a lost node's jobs wait for
its agent's lease before they start elsewhere, their leases are revoked at once, a cancel revokes the lease
before it returns, a killed engine without evidence of memory pressure resumes, and starts that end without a
step are retried with a doubling pause, a bounded number of times; and strings it would store are checked
behind the API too."""

from __future__ import annotations

import signal

import pytest

from horizon_ray import exit_codes
from horizon_ray.cluster.exits import MAX_RETRIES, RETRY_AFTER_S, retry_pause_s
from horizon_ray.cluster.messages import EventType, JobStatus
from horizon_ray.job import lease

GiB = 2**30


def spec(steps: int = 10, every: int = 2) -> dict:
    return {"model": {"path": "/models/10GiB"}, "data": {"path": "/data/train.jsonl"},
            "training": {"max_steps": steps}, "checkpoint": {"every_steps": every}}


@pytest.fixture
def clock():
    return [1_000_000.0]


@pytest.fixture
def c(fake_cluster, clock):
    return fake_cluster({"a": "16GiB", "b": "64GiB"}, auto=False, clock=lambda: clock[0])


def fakes(c):
    return c.coordinator.fake_agents


def moves(c, job_id):
    return [(e.data["to"], e.data.get("reason") or "") for e in c.events("acme", job_id) if e.type is EventType.STATUS]


def test_a_lost_nodes_jobs_wait_for_its_agents_lease_and_lose_theirs_at_once(c, clock):
    fakes(c)["a"].engine_lease_s = 30.0  # its engines run on for up to 30 s after our last call
    c.tick()
    job = c.submit("acme", spec())
    assert job.node_id == "a"
    lease.grant(job.output_dir, job.id, job.attempts, "a")  # what the real agent did when it started it
    fakes(c)["a"].advance(job.id, 3)
    c.tick()
    fakes(c)["a"].kill()
    clock[0] += 1
    c.tick()
    rec = c.get("acme", job.id)
    assert rec.status is JobStatus.RECOVERING and "retrying in 29 s" in rec.queue_reason
    assert lease.read_lease(job.output_dir).revoked  # an engine that still sees it stops at its next step
    clock[0] += 28
    c.tick()
    assert c.get("acme", job.id).status is JobStatus.RECOVERING
    clock[0] += 2
    c.tick()
    rec = c.get("acme", job.id)
    assert (rec.status, rec.node_id, rec.attempts) == (JobStatus.RUNNING, "b", 2)
    assert fakes(c)["b"].jobs[job.id].step == 2  # from its last checkpoint


def test_a_cancel_revokes_the_lease_before_it_returns(c):
    job = c.submit("acme", spec())
    lease.grant(job.output_dir, job.id, job.attempts, job.node_id)
    assert c.cancel("acme", job.id).status in (JobStatus.CANCELLING, JobStatus.CANCELLED)
    assert lease.read_lease(job.output_dir).revoked


def test_a_killed_engine_without_evidence_of_memory_pressure_resumes_from_its_checkpoint(c, clock):
    job = c.submit("acme", spec(steps=6))
    fakes(c)["a"].advance(job.id, 3)  # a checkpoint at step 2
    fakes(c)["a"].crash(job.id, -signal.SIGKILL)  # kill -9, below its plan, no OOM kill counted
    c.tick()
    rec = c.get("acme", job.id)
    assert rec.status is JobStatus.RECOVERING and rec.error is None
    assert "killed by SIGKILL with no sign of memory pressure" in rec.queue_reason
    clock[0] += RETRY_AFTER_S
    c.tick()
    rec = c.get("acme", job.id)
    assert rec.status is JobStatus.RUNNING and rec.attempts == 2
    agent = fakes(c)[rec.node_id]
    assert agent.jobs[job.id].step == 2
    agent.advance(job.id, 4)
    assert c.get("acme", job.id).status is JobStatus.SUCCEEDED


def test_starts_without_a_step_are_retried_with_a_doubling_pause_then_fail(c, clock):
    job = c.submit("acme", spec())
    for n in range(1, MAX_RETRIES + 1):
        rec = c.get("acme", job.id)
        assert rec.status is JobStatus.RUNNING and rec.attempts == n
        fakes(c)[rec.node_id].crash(job.id, exit_codes.OUTPUT_DIR_BUSY, "error: another job is running in ...")
        c.tick()
        assert c.get("acme", job.id).status is JobStatus.RECOVERING
        clock[0] += retry_pause_s(n) - 1
        c.tick()
        assert c.get("acme", job.id).status is JobStatus.RECOVERING, f"started again before pause {n}"
        clock[0] += 1
        c.tick()
    rec = c.get("acme", job.id)
    fakes(c)[rec.node_id].crash(job.id, exit_codes.OUTPUT_DIR_BUSY, "error: another job is running in ...")
    c.tick()
    rec = c.get("acme", job.id)
    assert rec.status is JobStatus.FAILED and rec.error.code == "output_dir_busy"
    assert f"started {MAX_RETRIES + 1} times in a row" in rec.error.message
    assert rec.attempts == MAX_RETRIES + 1


def test_a_step_forgives_the_starts_before_it(c, clock):
    job = c.submit("acme", spec(steps=100, every=1))
    for _ in range(MAX_RETRIES + 3):
        rec = c.get("acme", job.id)
        agent = fakes(c)[rec.node_id]
        agent.advance(job.id, 1)  # it trains a step, then dies
        agent.crash(job.id, -signal.SIGSEGV)
        c.tick()
        clock[0] += retry_pause_s(1)
        c.tick()
    rec = c.get("acme", job.id)
    # more crashes than MAX_RETRIES, each after a step: still running, only the last one counted
    assert (rec.status, rec.attempts, rec.retries) == (JobStatus.RUNNING, MAX_RETRIES + 4, 1)


@pytest.mark.parametrize("field, value", [("name", "a\ud800"), ("name", "x\ny"), ("idempotency_key", "k\x00"),
                                          ("name", "n" * 2000)])
def test_the_coordinator_refuses_what_would_break_its_table(c, field, value):
    """Defence in depth behind the API's edge: a submit from the CLI or the Ray client is checked too."""
    from horizon_ray.cluster.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as info:
        c.submit("acme", spec(), **{field: value})
    assert info.value.details["field"] == field
    assert c.list("acme")[0] == []


def test_an_engine_that_exits_between_the_poll_and_the_ledger_is_recorded_before_its_place_is_reused(c, clock):
    """The agent reaps an engine between the coordinator's poll (still running) and its info (the place free):
    the job's end is recorded in that pass, before the next job starts there (its finish precedes that start)."""
    first = c.submit("acme", spec(steps=5))
    agent = fakes(c)[first.node_id]
    agent.advance(first.id, 4)
    c.tick()
    info = agent.info

    def info_after_the_engine_exited():
        agent.advance(first.id, 1)  # the last step: it exits, and its reservation goes
        agent.info = info
        return info()

    agent.info = info_after_the_engine_exited
    c.tick()
    done = c.coordinator.get("acme", first.id)  # as that one pass left it (the client's get would tick again)
    assert done.status is JobStatus.SUCCEEDED and done.finished_at is not None
