"""The coordinator never waits on a node while it holds its lock: agents are asked at once and outside it, a
submit or a cancel does not run a pass, and the actor's methods are the client protocol's. No Ray cluster."""

from __future__ import annotations

import inspect
import threading

from horizon_ray.cluster.client import CoordinatorClient
from horizon_ray.cluster.coordinator import Coordinator
from horizon_ray.cluster.fake import FakeAgent, size_planner
from horizon_ray.cluster.messages import JobStatus

WAIT_S = 30.0  # how long a test waits for a condition that holds at once on the new code


def spec(size: str = "10GiB", steps: int = 100) -> dict:
    return {"model": {"path": f"/models/{size}"}, "data": {"path": "/data/train.jsonl"},
            "training": {"max_steps": steps}, "checkpoint": {"every_steps": 0}}


class GatedAgent(FakeAgent):
    """A fake agent whose poll waits at `entered` (a barrier all gated agents cross together) and then for
    `release`: a node that answers late."""

    def __init__(self, *args, entered: threading.Barrier, release: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.release, self.gated = entered, release, False

    def poll(self, offsets):
        if self.gated:
            self.entered.wait(WAIT_S)
            assert self.release.wait(WAIT_S)
        return super().poll(offsets)


def test_agents_are_asked_at_once_and_no_call_waits_on_a_slow_one(tmp_path):
    entered, release = threading.Barrier(3), threading.Event()  # two agents and this test
    agents = {n: GatedAgent(n, "64GiB", auto=False, entered=entered, release=release) for n in ("a", "b")}
    core = Coordinator(store_path=tmp_path / "jobs.sqlite", jobs_root=tmp_path / "jobs", agents=agents,
                       planner=size_planner)
    try:
        core.tick()
        job = core.submit("acme", spec())
        core.tick()
        job = core.get("acme", job.id)
        assert job.status is JobStatus.RUNNING
        for a in agents.values():
            a.gated = True
        ticking = threading.Thread(target=core.tick)
        ticking.start()
        # both agents are inside their poll at the same time: asked at once, not one after the other
        entered.wait(WAIT_S)
        assert not entered.broken
        # while they have not answered, every call of the client protocol is answered
        answered = {}
        calls = {"list": lambda: core.list("acme"), "get": lambda: core.get("acme", job.id),
                 "events": lambda: core.events("acme", job.id), "nodes": core.nodes, "queue": core.queue,
                 "submit": lambda: core.submit("acme", spec("1GiB")), "cancel": lambda: core.cancel("acme", job.id)}
        caller = threading.Thread(target=lambda: answered.update({k: f() for k, f in calls.items()}))
        caller.start()
        caller.join(WAIT_S)
        assert not caller.is_alive(), "a call waited for an agent that had not answered"
        assert set(answered) == set(calls) and answered["cancel"].status is JobStatus.CANCELLING
        assert answered["submit"].status is JobStatus.QUEUED
        release.set()
        ticking.join(WAIT_S)
        assert not ticking.is_alive()
        for a in agents.values():
            a.gated = False
        core.tick()  # the cancel reached the engine in the pass that was under way; this one sees it exit
        assert core.get("acme", job.id).status is JobStatus.CANCELLED
    finally:
        release.set()
        core.close()


def test_an_agent_whose_forget_fails_is_asked_again_and_its_job_ends_once(tmp_path):
    agent = FakeAgent("a", "16GiB", auto=False)
    core = Coordinator(store_path=tmp_path / "jobs.sqlite", jobs_root=tmp_path / "jobs", agents={"a": agent},
                       planner=size_planner)
    try:
        core.tick()
        job = core.submit("acme", spec(steps=1))
        core.tick()
        real, calls = agent.forget, []

        def flaky(job_id):
            calls.append(job_id)
            if len(calls) == 1:
                raise ConnectionError("reset")
            real(job_id)

        agent.forget = flaky
        agent.advance(job.id)
        core.tick()  # the exit is recorded; the forget fails
        core.tick()  # reported again: asked again
        assert calls == [job.id, job.id] and agent.jobs == {}
        statuses = [e.data["to"] for e in core.events("acme", job.id) if e.type.value == "status"]
        assert statuses.count("succeeded") == 1
    finally:
        core.close()


def test_the_coordinator_actor_answers_the_client_protocol_method_by_method():
    from horizon_ray.cluster.ray_actors import CoordinatorActor

    protocol = {n for n, f in vars(CoordinatorClient).items() if inspect.isfunction(f) and not n.startswith("_")}
    assert protocol == {"submit", "get", "list", "cancel", "events", "checkpoints", "plan", "nodes", "queue",
                        "ready"}
    def params(f):  # Ray's tracing adds a keyword of its own to an actor class's methods, the gate _credential
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()
                if p.name not in ("_ray_trace_ctx", "_credential")]

    for name in protocol:
        assert params(getattr(CoordinatorActor, name)) == params(getattr(CoordinatorClient, name)), name
    assert not hasattr(CoordinatorActor, "call")  # no method dispatched by its name
    for name in (*protocol, "whoami"):  # each takes the caller's credential for the gate
        assert "_credential" in inspect.signature(getattr(CoordinatorActor, name)).parameters, name
