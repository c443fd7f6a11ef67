"""In-process twins of the node agents, for tests of the coordinator and of the API (no Ray, no engine).

`FakeAgent` "runs" a job by emitting the events a real job runner would (`horizon_ray.job.events`: start,
metrics per step, checkpoints, done) on each poll, and keeps checkpoints in a `FakeStorage` shared by the
agents of one fake cluster, so a job recovered on another agent resumes from its last checkpoint. Tests steer
it: hold a job, crash it, OOM-kill it, kill or restart the agent.

`make_local_client` builds a `LocalClient` over a `Coordinator` with one fake agent per node, each declared
like a node of `--simulate-nodes` (RAM, then optional logical GPUs and cores)::

    client = make_local_client(tmp_path, nodes={"a": "16GiB", "b": "64GiB:2gpu:8cpu"})
    job = client.submit("acme", spec)

A fake agent keeps the real agent's ledger (RAM, GPU indices, core shares) and records, per job, the
environment the real agent would give its engine (`FakeJob.env`: CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, ...).

With the default planner, a spec whose `model.path` ends in a size ("/models/40GiB") needs that much host
RAM; any other spec goes to the real planner.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from horizon_ray.cluster import placement
from horizon_ray.cluster.agent import engine_env
from horizon_ray.cluster.agent_protocol import AgentUnavailable
from horizon_ray.cluster.client import LocalClient
from horizon_ray.cluster.coordinator import Coordinator, default_validate_spec
from horizon_ray.cluster.ledger import Ledger
from horizon_ray.cluster.messages import AgentJobReport, ExitInfo, Launch, NodeInfo, Reservation
from horizon_ray.cluster.nodes import parse_node_value
from horizon_ray.cluster.placement import default_planner
from horizon_ray.cluster.tenants import TenantsConfig, parse_bytes
from horizon_ray.job.events import Checkpoint, CheckpointBegin, Done, Error, Eval, Event, Metrics, Start


@dataclass
class FakeStorage:
    """The shared filesystem of a fake cluster: the runner's events and checkpoints per output_dir."""

    events: dict[str, list[Event]] = field(default_factory=dict)  # output_dir -> its metrics.jsonl
    checkpoints: dict[str, list[int]] = field(default_factory=dict)  # output_dir -> complete steps


@dataclass
class FakeJob:
    job_id: str
    output_dir: str
    total_steps: int
    checkpoint_every: int
    step: int = 0
    keep: int = 2  # the spec's checkpoint.keep: older checkpoints are pruned, as the runner does
    held: bool = False  # no progress while held
    cancel_requested: bool = False
    exit: ExitInfo | None = None
    planned_bytes: int = 0
    rss_bytes: int = 0
    env: dict[str, str] = field(default_factory=dict)  # what the real agent would set for its engine
    preference: bool = False  # objective dpo: its metrics carry TRL's rewards, as the runner's do


def fake_rewards(step: int, total_steps: int) -> dict[str, float]:
    """A fake DPO step's metrics (TRL's names): the margin grows 0.1 a step, the accuracy to 1 at the last step
    (the end's eval: to 0.5, as if `total_steps` were twice as many)."""
    return {"loss": 1.0 / step, "rewards/chosen": 0.05 * step, "rewards/rejected": -0.05 * step,
            "rewards/accuracies": min(1.0, step / total_steps), "rewards/margins": 0.1 * step,
            "logps/chosen": -20.0 + step, "logps/rejected": -20.0 - step}


class FakeAgent:
    """A node agent whose jobs advance `steps_per_poll` steps on every poll."""

    def __init__(
        self,
        node_id: str,
        ram_bytes: int | str,
        *,
        gpu_count: int = 0,
        gpu_memory_bytes: int | str = 0,
        cpu_count: int = 0,
        storage: FakeStorage | None = None,
        total_steps: int | None = None,
        steps_per_poll: int = 1,
        checkpoint_every: int | None = None,
        auto: bool = True,
    ):
        self.node_id = node_id
        self.ledger = Ledger(parse_bytes(ram_bytes), gpu_count, parse_bytes(gpu_memory_bytes), cpu_count=cpu_count)
        self.storage = storage or FakeStorage()
        self.total_steps = total_steps  # overrides the spec's training.max_steps (default 3) when set
        self.steps_per_poll = steps_per_poll
        self.checkpoint_every = checkpoint_every  # overrides the spec's checkpoint.every_steps when set
        self.auto = auto  # advance on poll; otherwise only `advance()` moves jobs
        self.engine_lease_s = 0.0  # how long its engines outlive the coordinator's last call (NodeInfo's)
        self.alive = True
        self.incarnation = uuid.uuid4().hex[:12]
        self.jobs: dict[str, FakeJob] = {}
        self.started: list[str] = []  # job ids in the order they were started here

    # ---- the Agent interface -------------------------------------------------------------------------

    def info(self) -> NodeInfo:
        self._check_alive()
        return self.ledger.node_info(self.node_id, incarnation=self.incarnation,
                                     engine_lease_s=self.engine_lease_s)

    def start(self, launch: Launch) -> Reservation:
        self._check_alive()
        job_id, spec, output_dir, host_bytes = launch.job_id, launch.spec, launch.output_dir, launch.host_bytes
        if job_id in self.jobs and self.jobs[job_id].exit is None:
            return self.ledger.entries[job_id]
        needs_gpu = placement.needs_gpu(spec, self.ledger.gpu_count) if launch.needs_gpu is None else launch.needs_gpu
        res = self.ledger.reserve(job_id, host_bytes, launch.gpu_bytes, needs_gpu, tenant=launch.tenant,
                                  gpus=launch.gpus, cpu_threads=launch.cpu_threads)
        training = spec.get("training") or {}
        total = self.total_steps or training.get("max_steps") or 3
        every = self.checkpoint_every
        if every is None:
            every = (spec.get("checkpoint") or {}).get("every_steps") or 0
        done = self.storage.checkpoints.get(output_dir, [])
        keep = int((spec.get("checkpoint") or {}).get("keep") or 2)
        job = FakeJob(job_id, output_dir, int(total), int(every), step=max(done, default=0), keep=keep,
                      planned_bytes=int(host_bytes), rss_bytes=int(host_bytes * 0.9),
                      env=engine_env(res, [str(i) for i in range(self.ledger.gpu_count)]),
                      preference=spec.get("objective") == "dpo")
        self.jobs[job_id] = job
        self.started.append(job_id)
        self._emit(Start(step=job.step, total_steps=job.total_steps), job)
        return res

    def cancel(self, job_id: str) -> None:
        self._check_alive()
        job = self.jobs.get(job_id)
        if job is not None and job.exit is None:
            job.cancel_requested = True

    def poll(self, offsets: dict[str, int]) -> dict[str, AgentJobReport]:
        self._check_alive()
        reports = {}
        for job in self.jobs.values():
            if job.exit is None:
                if job.cancel_requested:
                    self._exit(job, -15)
                elif self.auto and not job.held:
                    self.advance(job.job_id, self.steps_per_poll)
            events = self.storage.events.get(job.output_dir, [])
            start = min(int(offsets.get(job.job_id, 0)), len(events))
            reports[job.job_id] = AgentJobReport(
                job_id=job.job_id, events=events[start:], next_offset=len(events),
                rss_bytes=job.rss_bytes if job.exit is None else 0, peak_rss_bytes=job.rss_bytes,
                exit=job.exit)
        return reports

    def forget(self, job_id: str) -> None:
        self._check_alive()
        self.jobs.pop(job_id, None)
        self.ledger.release(job_id)

    # ---- steering (tests) ----------------------------------------------------------------------------

    def advance(self, job_id: str, steps: int = 1) -> None:
        """Train `steps` more steps (checkpointing on schedule; exiting 0 after the last)."""
        job = self.jobs[job_id]
        for _ in range(steps):
            if job.exit is not None:
                return
            job.step += 1
            self._emit(Metrics(step=job.step, loss=1.0 / job.step, lr=1e-4, grad_norm=1.0, tokens_per_s=1000.0,
                               host_rss_bytes=job.rss_bytes, total_steps=job.total_steps,
                               eta_s=float(job.total_steps - job.step),
                               preference=fake_rewards(job.step, job.total_steps) if job.preference else None), job)
            if job.checkpoint_every and job.step % job.checkpoint_every == 0:
                kept = self.storage.checkpoints.setdefault(job.output_dir, [])
                kept.append(job.step)
                pruned, kept[:] = kept[:-job.keep], kept[-job.keep:]
                self._emit(CheckpointBegin(step=job.step), job)
                self._emit(Checkpoint(step=job.step, path=f"{job.output_dir}/checkpoints/step-{job.step:08d}",
                                      pruned=pruned), job)
            if job.step >= job.total_steps:
                if job.preference:  # the eval of the run's end, over held-out pairs
                    self._emit(Eval(step=job.step, eval_loss=0.5, eval_tokens=8,
                                    eval_preference=fake_rewards(job.step, 2 * job.total_steps)), job)
                self._emit(Done(step=job.step, final_dir=f"{job.output_dir}/final"), job)
                self._exit(job, 0)

    def hold(self, job_id: str, held: bool = True) -> None:
        self.jobs[job_id].held = held

    def set_checkpointing(self, job_id: str) -> None:
        """The job starts writing a checkpoint (and holds there until it advances)."""
        job = self.jobs[job_id]
        self._emit(CheckpointBegin(step=job.step), job)

    def crash(self, job_id: str, returncode: int = 1, message: str = "RuntimeError: boom") -> None:
        """The engine exits with `returncode` (negative: killed by that signal)."""
        job = self.jobs[job_id]
        if returncode > 0:
            self._emit(Error(step=job.step, message=message), job)
        self._exit(job, returncode, stderr=message)

    def oom(self, job_id: str, rss_bytes: int | None = None) -> None:
        """The kernel's OOM killer SIGKILLs the engine after it grew to `rss_bytes`."""
        job = self.jobs[job_id]
        job.rss_bytes = rss_bytes if rss_bytes is not None else int(job.planned_bytes * 1.5)
        self._exit(job, -9)

    def kill(self) -> None:
        """The node (or its agent) dies: every call fails from now on, its jobs are gone."""
        self.alive = False
        self.jobs.clear()
        self.ledger.entries.clear()

    def restart(self) -> None:
        """The agent comes back empty, with a new incarnation."""
        self.kill()
        self.alive = True
        self.incarnation = uuid.uuid4().hex[:12]

    # ---- internals -----------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self.alive:
            raise AgentUnavailable(f"agent {self.node_id} is dead", definitive=True)

    def _emit(self, event: Event, job: FakeJob) -> None:
        self.storage.events.setdefault(job.output_dir, []).append(event)

    def _exit(self, job: FakeJob, returncode: int, stderr: str = "") -> None:
        job.exit = ExitInfo(returncode=returncode, cancelled=job.cancel_requested,
                            peak_rss_bytes=job.rss_bytes, stderr_tail=stderr, time=time.time())
        self.ledger.release(job.job_id)


def size_planner(spec: dict[str, Any], node: NodeInfo) -> dict[str, Any]:
    """Test planner: host bytes from a size at the end of model.path ("/models/40GiB"), else the real one."""
    path = str((spec.get("model") or {}).get("path") or "")
    try:
        host = parse_bytes(Path(path).name)
    except ValueError:
        return default_planner(spec, node)
    fits = host <= node.ram_bytes
    return {"host_bytes": host, "gpu_bytes": 0, "fits": fits,
            "reason": "fits" if fits else f"needs {host} bytes of host RAM, node has {node.ram_bytes}"}


class FakeCoordinator(Coordinator):
    """A Coordinator over FakeAgents, which it keeps at `fake_agents` for tests to drive by hand."""

    def __init__(self, *, agents: dict[str, FakeAgent], **kwargs: Any):
        super().__init__(agents=agents, **kwargs)
        self.fake_agents = agents  # node id -> its FakeAgent


def make_local_client(
    root: str | Path,
    nodes: Mapping[str, int | str] | None = None,
    *,
    tenants: TenantsConfig | dict | None = None,
    planner: Callable[[dict[str, Any], NodeInfo], dict[str, Any]] = size_planner,
    validate_spec: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    clock: Callable[[], float] = time.time,
    **agent_kwargs: Any,
) -> LocalClient:
    """A `LocalClient` over a fresh coordinator (job table in `root`) with a `FakeAgent` per node.

    The agents are at `client.coordinator.fake_agents` (node id -> FakeAgent)."""
    root = Path(root)
    storage = FakeStorage()
    agents: dict[str, FakeAgent] = {}
    for name, value in (nodes or {"a": "16GiB", "b": "64GiB", "c": "256GiB"}).items():
        node = parse_node_value(name, value)
        declared = {"gpu_count": node.gpu_count, "gpu_memory_bytes": node.gpu_memory_bytes} if node.gpu_count else {}
        if node.cpu_count is not None:
            declared["cpu_count"] = node.cpu_count
        agents[name] = FakeAgent(name, node.ram_bytes, storage=storage, **{**agent_kwargs, **declared})
    if isinstance(tenants, dict):
        tenants = TenantsConfig.from_dict(tenants)
    coordinator = FakeCoordinator(store_path=root / "jobs.sqlite", jobs_root=root / "jobs", agents=agents,
                                  planner=planner, validate_spec=validate_spec or default_validate_spec,
                                  tenants=tenants, clock=clock)
    coordinator.tick()
    return LocalClient(coordinator)
