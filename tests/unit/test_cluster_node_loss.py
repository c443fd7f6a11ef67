"""A node that goes away under the coordinator, as Ray reports it through the agent proxies (`RayAgentProxy`): the
coordinator core over proxies whose Ray handles are stand-ins, so that the order of a pass (ask every agent, then
place) meets the node's death where a loaded machine puts it. No Ray cluster.

Ray pins each agent to its node (NodeAffinitySchedulingStrategy, soft=False). Once that node is gone, a call to
the agent raises ActorUnschedulableError (not a RayActorError) for a while before the actor's name goes from the
named-actor list; a pass that listed the agents before then makes its calls to a dead agent.
"""

from __future__ import annotations

from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError, ActorUnschedulableError, RayTaskError

from horizon_ray.cluster import JobStatus, ray_actors
from horizon_ray.cluster.agent_protocol import AgentUnavailable, ReservationRefused
from horizon_ray.cluster.coordinator import Coordinator
from horizon_ray.cluster.fake import FakeAgent, FakeStorage, size_planner

GiB = 2**30
UNSCHEDULABLE = ("The node specified via NodeAffinitySchedulingStrategy doesn't exist any more or is infeasible, and "
                 "soft=False was specified.")  # Ray's words, after "The actor is not schedulable: "


class Handle:
    """A Ray actor handle's stand-in over a FakeAgent: `handle.method.remote(...)` gives a call that `ray.get`
    (patched below) runs. `gone_after`: the number of calls it still answers before its node is gone; `fails`:
    method -> the error Ray raises for a call of it (the agent never sees the call)."""

    def __init__(self, agent: FakeAgent):
        self.agent = agent
        self.gone_after: int | None = None
        self.fails: dict[str, Exception] = {}

    def __getattr__(self, method: str) -> Any:
        handle = self

        class Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any):
                def call():
                    if handle.gone_after is not None:
                        if handle.gone_after <= 0:
                            raise ActorUnschedulableError(UNSCHEDULABLE)
                        handle.gone_after -= 1
                    if method in handle.fails:
                        raise handle.fails[method]
                    try:
                        return getattr(handle.agent, method)(*args, **kwargs)
                    except Exception as exc:  # what the agent's own code raises comes back as a RayTaskError
                        raise RayTaskError(method, "Traceback: ...", exc).as_instanceof_cause() from None
                return call

        return Method()


@pytest.fixture(autouse=True)
def ray_get_runs_the_call(monkeypatch):
    monkeypatch.setattr(ray_actors.ray, "get", lambda call, timeout=None: call())


def unavailable() -> ActorUnavailableError:
    return ActorUnavailableError("The actor is temporarily unavailable: RpcError: failed to connect", None)


def spec(steps: int = 100) -> dict:
    return {"model": {"path": "/models/1GiB"}, "data": {"path": "/data/train.jsonl"},
            "training": {"max_steps": steps}, "checkpoint": {"every_steps": 0}}


def test_a_call_ray_cannot_deliver_is_an_unavailable_agent_and_the_agents_own_errors_pass():
    agent = FakeAgent("a", 16 * GiB)
    proxy = ray_actors.RayAgentProxy(Handle(agent), "a")
    assert proxy.info().node_id == "a"
    proxy.handle.gone_after = 0
    with pytest.raises(AgentUnavailable) as gone:
        proxy.poll({})
    assert gone.value.definitive and "ActorUnschedulableError" in str(gone.value)

    proxy.handle.gone_after = None
    proxy.handle.fails["info"] = unavailable()
    with pytest.raises(AgentUnavailable) as slow:
        proxy.info()
    assert not slow.value.definitive

    def refuse(launch):
        raise ReservationRefused("node a is draining (its pod is stopping)")

    agent.start = refuse  # type: ignore[method-assign]
    with pytest.raises(ReservationRefused, match="^node a is draining"):  # the agent's own answer, as it raised it
        proxy.start(None)  # type: ignore[arg-type]


def test_a_drained_job_is_not_failed_by_its_node_going_between_the_asks_and_the_start(tmp_path):
    """The pod of node `old` is deleted while a job trains there: its preStop hook drains the node (the engine
    checkpoints and exits 143, the agent refuses new jobs) and the pod goes. A pass that asked `old` while it
    was up then starts the recovering job there, after the node is gone: Ray answers ActorUnschedulableError.
    That says nothing about the job: it resumes on the node that replaces `old` (it used to fail, START_FAILED)."""
    now = [1000.0]
    storage = FakeStorage()
    old = FakeAgent("old", 16 * GiB, storage=storage, auto=False)
    agents = {"old": ray_actors.RayAgentProxy(Handle(old), "old")}
    core = Coordinator(store_path=tmp_path / "jobs.sqlite", jobs_root=tmp_path / "jobs", agents=agents,
                       planner=size_planner, clock=lambda: now[0])
    try:
        core.tick()
        job = core.submit("acme", spec())
        core.tick()
        assert core.get("acme", job.id).node_id == "old"
        old.advance(job.id, 5)
        storage.checkpoints[core.get("acme", job.id).output_dir] = [5]
        old.crash(job.id, 143, "stopped after step 5 to leave its node (drain)")  # the preStop hook
        old_start = old.start

        def draining(launch):
            raise ReservationRefused("node old is draining (its pod is stopping)")

        old.start = draining  # type: ignore[method-assign]
        core.tick()
        assert core.get("acme", job.id).status is JobStatus.RECOVERING
        now[0] += 11  # past the pause after a stop from outside
        core.tick()
        assert "node old refused it" in core.get("acme", job.id).queue_reason

        # The pod goes right after `old` answered this pass's asks (poll, info): the start comes too late.
        old.start = old_start  # type: ignore[method-assign]
        agents["old"].handle.gone_after = 2
        core.tick()
        rec = core.get("acme", job.id)
        assert rec.status is JobStatus.RECOVERING, (rec.status, rec.error)
        assert rec.error is None and job.id not in old.jobs
        core.tick()  # Ray still lists the agent's name: the asks say it is gone for good
        assert {n.node_id: n.alive for n in core.nodes()} == {"old": False}

        # The replacement pod's node comes up with its agent: the job resumes there from the drain's checkpoint.
        del agents["old"]
        new = FakeAgent("new", 16 * GiB, storage=storage, auto=False)
        agents["new"] = ray_actors.RayAgentProxy(Handle(new), "new")
        core.tick()
        rec = core.get("acme", job.id)
        assert rec.status is JobStatus.RUNNING and rec.node_id == "new" and rec.attempts == 2, rec
        assert new.jobs[job.id].step == 5
    finally:
        core.close()


def test_no_job_is_placed_on_a_node_that_did_not_answer_this_pass(tmp_path):
    """A node in its grace period (it did not answer, and is not declared lost yet) keeps its jobs but gets no
    new one: a start there would meet the same failure, or land on a node about to be lost."""
    now = [1000.0]
    slow, other = FakeAgent("a", 16 * GiB, auto=False), FakeAgent("b", 64 * GiB, auto=False)
    agents = {"a": ray_actors.RayAgentProxy(Handle(slow), "a"), "b": ray_actors.RayAgentProxy(Handle(other), "b")}
    core = Coordinator(store_path=tmp_path / "jobs.sqlite", jobs_root=tmp_path / "jobs", agents=agents,
                       planner=size_planner, clock=lambda: now[0])
    try:
        core.tick()
        agents["a"].handle.fails["poll"] = unavailable()
        job = core.submit("acme", spec())  # best fit: a (16 GiB), while it answers
        core.tick()
        rec = core.get("acme", job.id)
        assert rec.status is JobStatus.RUNNING and rec.node_id == "b", rec
        assert {n.node_id: n.alive for n in core.nodes()} == {"a": True, "b": True}  # not lost yet

        # A job only b can hold waits while b is silent: it is neither started there nor refused as fitting no node.
        del agents["a"].handle.fails["poll"]
        agents["b"].handle.fails["poll"] = unavailable()
        big = core.submit("acme", {**spec(), "model": {"path": "/models/40GiB"}})
        core.tick()
        assert core.get("acme", big.id).status is JobStatus.QUEUED and big.id not in other.jobs
        del agents["b"].handle.fails["poll"]
        core.tick()
        rec = core.get("acme", big.id)
        assert rec.status is JobStatus.RUNNING and rec.node_id == "b", rec
    finally:
        core.close()


def test_the_coordinators_log_is_written_beside_its_job_table_and_serve_prints_it(tmp_path):
    """The coordinator actor runs on the head, where no one reads its stderr: what it says of nodes and jobs goes to
    <root>/coordinator.log, which `serve` (a KubeRay head's horizon-control container) prints as it grows."""
    import io
    import logging
    import threading
    import time

    from horizon_ray.commands.serve import follow_log

    path = ray_actors.coordinator_log_path(tmp_path / "coordinator.sqlite")
    assert path == tmp_path / "coordinator.log"
    logger = logging.getLogger("horizon_ray.cluster")
    saved = logger.handlers[:], logger.level, logger.propagate
    out, stop = io.StringIO(), threading.Event()
    try:
        ray_actors.log_to_file(path)
        ray_actors.log_to_file(path)  # once per process, however often the actor is built
        logger.info("before serve started")
        follower = threading.Thread(target=follow_log, args=(path, path.stat().st_size, out, stop, 0.01))
        follower.start()
        logger.warning("node a is lost (its agent died); its jobs recover elsewhere")
        logger.debug("not at INFO")
        for handler in logger.handlers:
            handler.flush()
        deadline = time.monotonic() + 30  # the follower's thread may wait for a loaded machine's CPU
        while "node a is lost" not in out.getvalue() and time.monotonic() < deadline:
            stop.wait(0.01)
    finally:
        stop.set()
        for handler in logger.handlers[:]:
            if handler not in saved[0]:
                logger.removeHandler(handler)
                handler.close()
        logger.setLevel(saved[1])
        logger.propagate = saved[2]
    follower.join(5)
    printed = out.getvalue()
    assert "WARNING coordinator: node a is lost (its agent died)" in printed, printed
    assert "before serve started" not in printed and "not at INFO" not in printed
    assert path.read_text().count("before serve started") == 1  # one file handler
