"""The coordinator core: job table, state machine, tenant quotas, fair queue, placement and recovery.

Plain Python, no Ray: it takes its node agents (node id -> `Agent`), its clock, its planner and the path of
its sqlite job table as arguments, so unit tests drive it with fake agents and a fake clock
(`horizon_ray.cluster.fake`). `ray_actors.CoordinatorActor` wraps it in the named, detached Ray actor and
calls `tick()` twice a second, and at once after a submit or a cancel.

One `tick()`:
1. ask every agent at once, outside the coordinator's lock, for its node (RAM, GPUs, ledger) and its jobs'
   reports (new metrics lines, exits): a slow or unreachable node delays no API call and no other node;
2. under the lock, apply the answers: progress, metrics, checkpoints, memory, and the end of finished jobs;
   an agent that could not be reached, or that restarted, loses its jobs: they go to RECOVERING;
3. serve the queue: recovering jobs first, then queued jobs in fair order across tenants, each on the
   best-fitting node that holds it now (free RAM, and resources.gpus free GPUs for a GPU job: see `placement`)
   and within its tenant's quota. The agent picks the GPUs; the job record keeps their indices
   (`gpu_indices`; `gpu_index` is the first).

Every change is written to the job table before the next one is made, so a coordinator restarted at any
point finds every non-terminal job; running jobs are reattached on the first tick (their agent still
reports them) or recovered (it does not).

Shared-storage assumption: a job's output_dir (`<jobs_root>/<tenant>/<job_id>/`) must be visible to every
node, so that a job recovered on another node finds its checkpoints. On one machine this holds trivially;
on several hosts, jobs_root must be a shared filesystem (NFS, a mounted bucket).
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from horizon_ray.cluster.agent_protocol import ENGINE_LEASE_S, Agent, AgentUnavailable, ReservationRefused
from horizon_ray.cluster.errors import (
    IdempotencyConflict,
    InvalidRequest,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    JobRejected,
    QuotaExceeded,
)
from horizon_ray.cluster.exits import MAX_RETRIES, exit_outcome, last_line, retry_pause_s
from horizon_ray.cluster.messages import (
    AgentJobReport,
    Checkpoint,
    ErrorCode,
    EventType,
    ExitInfo,
    JobError,
    JobEvent,
    JobRecord,
    JobStatus,
    Launch,
    NodeInfo,
    Reservation,
    TenantQuota,
    can_transition,
)
from horizon_ray.cluster.placement import (
    Candidate,
    Planner,
    best_fit,
    default_planner,
    evaluate,
    gpus_wanted,
    never_fits_reason,
    per_node_reasons,
    spec_section,
    waiting_reason,
)
from horizon_ray.cluster.reports import MemoryMark, apply_report
from horizon_ray.cluster.store import JobStore
from horizon_ray.cluster.tenants import TenantsConfig, check_tenant_name, fair_order, format_bytes
from horizon_ray.errors import BadInput
from horizon_ray.job import lease
from horizon_ray.job.metrics import METRICS_FILE
from horizon_ray.jobspec import TrainingSpec
from horizon_ray.strings import fix, problem

log = logging.getLogger("horizon_ray.cluster")
SpecValidator = Callable[[dict[str, Any]], dict[str, Any]]
WAITING = (JobStatus.RECOVERING, JobStatus.QUEUED)
ACTIVE = (JobStatus.RUNNING, JobStatus.CHECKPOINTING, JobStatus.CANCELLING)
_NOT_TRAINING_KEYS = ("output_dir",)  # spec keys that may differ between two submits of one job
_LIVE = tuple(s for s in JobStatus if not s.is_terminal())
# How each status change is logged (the service's log: `serve` prints the coordinator's; INFO otherwise)
_LEVELS = {JobStatus.RECOVERING: logging.WARNING, JobStatus.FAILED: logging.WARNING}
_CHECKPOINT_TOGGLE = {JobStatus.RUNNING, JobStatus.CHECKPOINTING}  # every checkpoint: DEBUG
_COUNTDOWN = re.compile(r"; retrying in -?[0-9]+ s")  # a waiting reason that only counts down is not logged again


# What a run leaves in its output_dir (the lease, metrics.jsonl, checkpoints/, final/): a new job refuses it.
_RUN_OUTPUTS = (lease.LEASE_FILE, METRICS_FILE, "checkpoints", "final")


def default_validate_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The job helper's strict JobSpec loader; returns the normalised spec (every default filled in, and what
    the checkpoint decides: JobSpec.with_checkpoint_settings)."""
    from horizon_ray.jobspec import JobSpec

    return JobSpec.from_dict(spec).with_checkpoint_settings().to_dict()


@dataclass
class _NodeState:
    node_id: str
    info: NodeInfo | None = None  # last report of its agent
    alive: bool = False  # reachable at the last tick
    failed_since: float | None = None  # first failed contact of the current outage
    incarnation: str | None = None  # the agent's incarnation seen last
    last_contact: float | None = None  # the last call it answered (its engines stop engine_lease_s after it)


@dataclass
class _Answer:
    """What one agent said in one pass, or why it said nothing."""

    reports: dict[str, AgentJobReport] = field(default_factory=dict)  # job id -> its report
    info: NodeInfo | None = None  # its node, read after the reports
    failure: Exception | None = None  # set when the agent could not be reached; reports and info are then empty


def _ask(agent: Agent, offsets: dict[str, int]) -> _Answer:
    """One agent's reports and node, outside the coordinator's lock (this is the call that may take seconds)."""
    try:
        reports = agent.poll(offsets)
        info = agent.info()  # after the poll, so that the ledger no longer holds jobs that exited
        held = {r.job_id for r in info.ledger}
        if any(r.exit is None and job_id not in held for job_id, r in reports.items()):
            # one exited between the two calls: its exit is recorded before its place is given away
            reports = agent.poll(offsets)
        return _Answer(reports, info)
    except Exception as exc:  # noqa: BLE001 - any failure to talk to an agent is an outage, judged by the caller
        return _Answer(failure=exc)


@dataclass
class _Usage:
    jobs: int = 0
    bytes: int = 0
    blocked_by: str | None = None  # id of the tenant's job that could not be served this pass
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Claim:
    """A waiting job's hold on the node it waits for: later jobs may take only what it does not need."""

    job_id: str
    gpus: int  # GPUs it needs there (0: a CPU job)
    host_bytes: int  # host RAM it needs there


def _behind_claim(c: Candidate, claim: _Claim | None) -> Candidate:
    """`c`, not placeable now where it would take what the node's claimant waits for."""
    if claim is None or not c.fits_now:
        return c
    gpus_ok = not c.gpus_taken or c.free_gpus - c.gpus_taken >= claim.gpus  # takes none, or leaves it enough
    if gpus_ok and c.free_bytes - c.host_bytes >= claim.host_bytes:
        return c
    return dataclasses.replace(c, fits_now=False, reason=f"node {c.node_id} is held for job {claim.job_id}, "
                                                         "which waits for it")


def _claim(job: JobRecord, cands: list[Candidate], claims: dict[str, _Claim]) -> None:
    """The node `job` waits for: of those that can hold it and no earlier job holds, the one it lacks least."""
    free = [c for c in cands if c.fits and c.node_id not in claims]
    if not free:
        return
    c = min(free, key=lambda c: (max(0, c.gpus_taken - c.free_gpus), max(0, c.host_bytes - c.free_bytes),
                                 c.node_id))
    claims[c.node_id] = _Claim(job.id, c.gpus_taken, c.host_bytes)


class Coordinator:
    """The job service's brain. Thread-safe: every public method holds one lock, which no call to an agent
    is made under except `start` (a placement is recorded before the next one is decided)."""

    def __init__(
        self,
        *,
        store_path: str | Path,
        jobs_root: str | Path,
        agents: Mapping[str, Agent] | Callable[[], Mapping[str, Agent]],
        planner: Planner = default_planner,
        validate_spec: SpecValidator = default_validate_spec,
        tenants: TenantsConfig | None = None,
        clock: Callable[[], float] = time.time,
        node_dead_after_s: float = 10.0,
        memory_event_interval_s: float = 10.0,
    ):
        self.store = JobStore(store_path)
        self.jobs_root = Path(jobs_root).expanduser().resolve()
        self._agents_source = agents
        self._planner = planner
        self._validate_spec = validate_spec
        self.tenants = tenants or TenantsConfig()
        self._clock = clock
        self._node_dead_after_s = node_dead_after_s
        self._memory_event_interval_s = memory_event_interval_s
        self._lock = threading.RLock()
        self._tick_lock = threading.Lock()  # one pass at a time: each asks with the offsets the last one stored
        self._askers = ThreadPoolExecutor(max_workers=32, thread_name_prefix="agent-poll")
        self._nodes: dict[str, _NodeState] = {}
        self._plan_cache: dict = {}
        self._not_before: dict[str, float] = {}  # job -> earliest time to place it again (after a stop)
        self._causes: dict[str, str] = {}  # recovering job -> why it recovers (its queue reasons start with it)
        self._memory: dict[str, MemoryMark] = {}
        self._last_created = 0.0
        self._started = clock()
        self._last_served: dict[str, int] = dict(self.store.get_meta("last_served", {}))
        self._serve_clock = int(self.store.get_meta("serve_clock", 0))
        self._recover_on_start()

    # ---- client interface (see client.CoordinatorClient) ---------------------------------------------

    def submit(self, tenant: str, spec: dict[str, Any], *, idempotency_key: str | None = None,
               priority: int = 0, name: str | None = None) -> JobRecord:
        with self._lock:
            self._check_tenant(tenant)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise InvalidRequest(f"priority is {priority!r}; give an integer (higher runs first)")
            for field, value in (("name", name), ("idempotency_key", idempotency_key)):
                bad = problem(value) if isinstance(value, str) else None if value is None else "is not a string"
                if bad:  # stored in the job table and shown in every listing
                    raise InvalidRequest(f"{field} {bad}; {fix(bad)}", field=field)
            if idempotency_key is not None:
                existing = self.store.find_idempotent(tenant, idempotency_key)
                if existing is not None:
                    same = _training_view(existing.spec) == _training_view(
                        self._normalise(spec, tenant, existing.id))
                    if not same:
                        raise IdempotencyConflict(
                            f"idempotency key {idempotency_key!r} was used for job {existing.id} with "
                            "another spec; use a new key for a new job", job_id=existing.id)
                    return existing
            quota = self.tenants.quota(tenant)
            waiting = [j for j in self.store.jobs(statuses=WAITING) if j.tenant == tenant]
            if len(waiting) >= quota.max_queued_jobs:
                raise QuotaExceeded(
                    f"tenant {tenant} already has {len(waiting)} jobs waiting (quota "
                    f"{quota.max_queued_jobs}); wait for some to start or cancel some",
                    limit="max_queued_jobs")
            job_id = f"job-{uuid.uuid4().hex[:12]}"
            full = self._normalise(spec, tenant, job_id)
            _check_budget(full, tenant, quota)
            mine = Path(full["output_dir"])
            for other in self.store.jobs(statuses=_LIVE):
                assert other.output_dir is not None, "submit gives every job its output_dir"
                theirs = Path(other.output_dir)
                if mine == theirs or mine.is_relative_to(theirs) or theirs.is_relative_to(mine):
                    who = f"job {other.id}" if other.tenant == tenant else "another job"
                    raise InvalidSpec(f"output_dir {full['output_dir']} is, holds or lies inside the output_dir of "
                                      f"{who}, which has not ended; give this job a directory of its own",
                                      field="output_dir")
            if (mine / "DONE").exists():
                raise InvalidSpec(f"output_dir {full['output_dir']} holds a finished run (its DONE marker); a job "
                                  "there would only report that run; give this job a new output_dir",
                                  field="output_dir")
            held = [name for name in _RUN_OUTPUTS if os.path.lexists(mine / name)]
            if held:  # a job is its own: another run's lease, metrics or checkpoints would be replayed as its own
                raise InvalidSpec(f"output_dir {full['output_dir']} holds another run's outputs ({', '.join(held)}); a "
                                  "job there would report that run's metrics and checkpoints as its own; give this "
                                  "job a new output_dir, or none (the service makes one per job)", field="output_dir")
            now = self._created_time()
            job = JobRecord(id=job_id, tenant=tenant, name=name if name is not None else full.get("name"),
                            status=JobStatus.VALIDATING, priority=priority, created_at=now, updated_at=now,
                            spec=full, output_dir=full["output_dir"], idempotency_key=idempotency_key)
            with self.store.transaction():
                self.store.put_job(job)
                self.store.add_event(job.id, now, EventType.STATUS, {"from": None, "to": "validating"})
            try:
                self._admit(job)
            except BaseException:
                self.store.delete_job(job.id)  # a refused or failed submit leaves no job, key or directory behind
                raise
            return job

    def get(self, tenant: str, job_id: str) -> JobRecord:
        with self._lock:
            return self._owned(tenant, job_id)

    def list(self, tenant: str, *, limit: int = 20, after: str | None = None,
             status: JobStatus | str | None = None) -> tuple[builtins.list[JobRecord], bool]:
        with self._lock:
            self._check_tenant(tenant)
            if not isinstance(limit, int) or not 1 <= limit <= 1000:
                raise InvalidRequest(f"limit is {limit!r}; give an integer from 1 to 1000")
            try:
                status = JobStatus(status) if status is not None else None
            except ValueError:
                raise InvalidRequest(f"status {status!r} is not a job status; use one of "
                                     f"{', '.join(s.value for s in JobStatus)}") from None
            return self.store.list_jobs(tenant, limit=limit, after=after, status=status)

    def cancel(self, tenant: str, job_id: str) -> JobRecord:
        with self._lock:
            job = self._owned(tenant, job_id)
            if job.status in (JobStatus.CANCELLED, JobStatus.CANCELLING):
                return job
            if job.status.is_terminal():
                raise InvalidTransition(f"job {job_id} already {job.status.value}; only a job that has not "
                                        "ended can be cancelled", status=job.status.value)
            if job.status not in (JobStatus.RUNNING, JobStatus.CHECKPOINTING):
                self._move(job, JobStatus.CANCELLED, reason="cancel requested")
                return job
            self._move(job, JobStatus.CANCELLING, reason="cancel requested")
            # When cancel returns, no engine of the job writes anything: the lease goes first (the engine
            # stops at its next check, wherever it runs), then the agent is asked to stop the process.
            self._revoke(job)
        agent = self._agents().get(job.node_id or "")
        if agent is not None:
            self._send_cancel(agent, job)  # outside the lock: a slow node delays only this caller
        return job

    def events(self, tenant: str, job_id: str, after_seq: int = 0, limit: int | None = None
               ) -> builtins.list[JobEvent]:
        with self._lock:
            self._owned(tenant, job_id)
            return self.store.events(job_id, after_seq=int(after_seq), limit=limit)

    def checkpoints(self, tenant: str, job_id: str) -> builtins.list[Checkpoint]:
        with self._lock:
            self._owned(tenant, job_id)
            return self.store.checkpoints(job_id)

    def plan(self, tenant: str, spec: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._check_tenant(tenant)
            full = self._normalise(spec, tenant, "job-plan")
            cands = evaluate(full, self._alive_infos(), self._planner)
            best = best_fit(cands)
            if not cands:
                decision, reason, node = "queue", "no node is available yet", None
            elif not any(c.fits for c in cands):
                decision, reason, node = "reject", never_fits_reason(cands), None
            elif best is None:
                decision, reason, node = "queue", waiting_reason(cands), None
            else:
                decision, reason, node = "place", f"best fit: node {best.node_id}", best.node_id
            shown = best or max((c for c in cands if c.fits), key=lambda c: c.ram_bytes, default=None)
            if shown is None and cands:
                shown = max(cands, key=lambda c: c.ram_bytes)
            return {"decision": decision, "node_id": node, "reason": reason,
                    "plan": shown.plan if shown else None, "nodes": [c.summary() for c in cands]}

    def nodes(self) -> builtins.list[NodeInfo]:
        with self._lock:
            out = []
            for st in sorted(self._nodes.values(), key=lambda s: s.node_id):
                info = st.info or NodeInfo(node_id=st.node_id, ram_bytes=0)
                out.append(_replace_alive(info, st.alive))
            return out

    def queue(self, tenant: str | None = None) -> builtins.list[JobRecord]:
        with self._lock:
            order = fair_order(self.store.jobs(statuses=WAITING), self._last_served)
            return [j for j in order if tenant is None or j.tenant == tenant]

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        self._askers.shutdown(wait=True)
        with self._lock:
            self.store.close()

    # ---- the control loop ----------------------------------------------------------------------------

    def tick(self) -> None:
        """One pass: ask every agent at once with no lock held; apply their answers under the lock; make the
        calls they ask for (forget an exited job, repeat a cancel) with no lock held; serve the queue under it.
        Only an agent's `start` is called under the lock."""
        with self._tick_lock:
            agents = self._agents()
            now = self._clock()
            with self._lock:
                asks = {node_id: self._offsets(node_id) for node_id in agents}
            answers = dict(zip(asks, self._askers.map(lambda n: _ask(agents[n], asks[n]), asks), strict=True))
            followups: builtins.list[Callable[[], None]] = []
            with self._lock:
                for node_id, agent in agents.items():
                    self._refresh_node(node_id, agent, answers[node_id], asks[node_id], now, followups)
                self._settle(now, agents)
            for call in followups:  # before the queue is served: a forgotten job's place is free on its node
                call()
            with self._lock:
                self._schedule(agents)

    def _offsets(self, node_id: str) -> dict[str, int]:
        """What to ask the node's agent for: the metrics offset of each job the table places there."""
        return {j.id: self.store.metrics_offset(j.id) for j in self.store.jobs(statuses=ACTIVE)
                if j.node_id == node_id}

    def _settle(self, now: float, agents: Mapping[str, Agent]) -> None:
        """After the answers: nodes whose agent is gone, and jobs on nodes that have no agent."""
        for node_id, st in builtins.list(self._nodes.items()):
            if node_id not in agents:
                self._node_failed(st, now, definitive=st.info is not None,
                                  why=f"the agent of node {node_id} is gone")
        for job in self.store.jobs(statuses=ACTIVE):
            assert job.node_id is not None, "an active job was placed on a node"
            if job.node_id not in self._nodes:
                # its agent last heard from the coordinator that ran before this one, at the latest
                st = self._nodes[job.node_id] = _NodeState(job.node_id, failed_since=self._started,
                                                           last_contact=self._started)
                self._node_failed(st, now, definitive=False, why=f"node {job.node_id} has no agent")

    # ---- nodes and reports ---------------------------------------------------------------------------

    def _refresh_node(self, node_id: str, agent: Agent, answer: _Answer, asked: dict[str, int], now: float,
                      followups: builtins.list[Callable[[], None]]) -> None:
        """Apply one agent's answer to the jobs it was asked about; calls to make to it go to `followups`."""
        st = self._nodes.setdefault(node_id, _NodeState(node_id))
        exc = answer.failure
        if isinstance(exc, AgentUnavailable):
            self._node_failed(st, now, definitive=exc.definitive, why=str(exc))
            return
        if exc is not None or answer.info is None:
            # the reason reaches the tenants of its jobs: the exception's text (addresses, ids) only the log
            log.warning("node %s did not answer: %s: %s", node_id, type(exc).__name__, exc)
            self._node_failed(st, now, definitive=False, why=f"its agent did not answer ({type(exc).__name__})")
            return
        reports, info = dict(answer.reports), answer.info
        # only the jobs it was asked about: none is placed there between the question and this (one pass at a time)
        mine = [j for j in self.store.jobs(statuses=ACTIVE) if j.node_id == node_id and j.id in asked]
        restarted = st.incarnation is not None and info.incarnation != st.incarnation
        if restarted:
            log.warning("node %s: its agent restarted (incarnation %s, was %s)", node_id, info.incarnation,
                        st.incarnation)
        elif not st.alive:
            log.info("node %s is up: %s RAM (%s free), %d GPU(s), agent incarnation %s", node_id,
                     format_bytes(info.ram_bytes), format_bytes(info.free_bytes), info.gpu_count, info.incarnation)
        elif st.failed_since is not None:
            log.info("node %s answers again, after %.0f s", node_id, now - st.failed_since)
        st.info, st.alive, st.failed_since, st.incarnation = info, True, None, info.incarnation
        st.last_contact = now
        for job in mine:
            report = reports.pop(job.id, None)
            if report is None:
                why = (f"the agent of node {node_id} restarted" if restarted
                       else f"its engine process on node {node_id} is gone")
                self._lost(job, why)
                continue
            self._apply_report(job, report)
            if report.exit is not None:
                self._finish(job, report.exit)
                followups.append(functools.partial(self._send_forget, agent, job.id))
            elif job.status is JobStatus.CANCELLING:
                # again each pass until the engine exits: a lost call is retried
                followups.append(functools.partial(self._send_cancel, agent, job))
        for job_id, report in reports.items():
            if not self._stray(node_id, job_id, report):
                followups.append(functools.partial(self._send_forget, agent, job_id))

    @staticmethod
    def _send_cancel(agent: Agent, job: JobRecord) -> None:
        """Ask the agent to stop the job's engine (idempotent there). A failed call is retried by the next
        pass over the node; an unreachable node ends in _lost(), which finishes the cancel."""
        try:
            agent.cancel(job.id)
        except Exception:  # noqa: BLE001 - retried next pass, see above
            pass

    @staticmethod
    def _send_forget(agent: Agent, job_id: str) -> None:
        """Tell the agent to drop an ended (or stray) job; a failed call is repeated by the next pass, which
        finds the job reported again."""
        try:
            agent.forget(job_id)
        except Exception as exc:  # noqa: BLE001 - repeated next pass, see above
            log.warning("could not tell node %s to forget %s: %s", getattr(agent, "node_id", "?"), job_id, exc)

    def _stray(self, node_id: str, job_id: str, report: AgentJobReport) -> bool:
        """A job the agent runs but the table does not place there: adopt it (True) or leave it to be stopped
        (False: the caller tells the agent to forget it)."""
        job = self.store.get_job(job_id)
        if job is not None and job.status in WAITING and report.exit is None:
            # The coordinator died between starting it and recording that: adopt it.
            job.node_id = node_id
            st = self._nodes.get(node_id)
            held = next((r for r in (st.info.ledger if st and st.info else []) if r.job_id == job_id), None)
            job.gpu_index = held.gpu_index if held else None
            job.gpu_indices = list(held.gpu_indices) if held else []
            job.attempts += 1
            job.started_at = job.started_at or self._clock()
            job.queue_reason = job.queue_position = None
            self._move(job, JobStatus.RUNNING, reason=f"reattached on node {node_id}")
            self._apply_report(job, report)
            return True
        return False

    def _node_failed(self, st: _NodeState, now: float, *, definitive: bool, why: str) -> None:
        if st.failed_since is None:
            st.failed_since = now
            if st.alive and not definitive:
                log.warning("node %s did not answer (%s); it is lost unless it answers within %.0f s", st.node_id,
                            why, self._node_dead_after_s)
        if not definitive and now - st.failed_since < self._node_dead_after_s:
            return
        if st.alive or st.incarnation is not None:
            log.warning("node %s is lost (%s); its jobs recover elsewhere", st.node_id, why)
        st.alive = False
        st.incarnation = None
        # Its agent may live on, cut off (a raylet killed under it): it stops its engines engine_lease_s after
        # it last heard from us; until then they are not started elsewhere. Their leases go at once, so that
        # any of them that can still see its output directory stops at its next step.
        held = st.info.engine_lease_s if st.info is not None else ENGINE_LEASE_S
        wait = max(0.0, (st.last_contact or now) + held - now)
        for job in self.store.jobs(statuses=ACTIVE):
            if job.node_id == st.node_id:
                self._revoke(job)
                self._lost(job, f"node {st.node_id} was lost ({why})", retry_after_s=wait)

    def _cause(self, job: JobRecord) -> str:
        """Why a recovering job recovers: what its waiting reasons start with (each pass builds them anew)."""
        if job.id not in self._causes:  # recovering since before this coordinator started: its stored reason
            self._causes[job.id] = _COUNTDOWN.split(job.queue_reason or "recovering")[0]
        return self._causes[job.id]

    def _revoke(self, job: JobRecord) -> None:
        """Revoke the lease of the job's current start on its output directory (see horizon_ray.job.lease)."""
        assert job.output_dir is not None, "submit gives every job its output_dir"
        try:
            lease.revoke(job.output_dir, job.id, job.attempts)
        except OSError as exc:  # storage this process cannot reach: the agent's lease stops the engine
            log.warning("could not revoke the lease of %s in %s: %s", job.id, job.output_dir, exc)

    def _lost(self, job: JobRecord, why: str, retry_after_s: float = 0.0) -> None:
        """Its engine process is gone without an exit report, or stopped resumably: recover it (or finish a
        cancel), not sooner than `retry_after_s` from now."""
        if job.status is JobStatus.CANCELLING:
            self._move(job, JobStatus.CANCELLED, reason=f"cancelled; {why}")
            return
        if retry_after_s:
            self._not_before[job.id] = self._clock() + retry_after_s
        ckpt = job.last_checkpoint_step
        job.queue_reason = f"{why}; resumes from " + (f"checkpoint step {ckpt}" if ckpt is not None
                                                        else "the start (no checkpoint yet)")
        self._causes[job.id] = job.queue_reason
        self._move(job, JobStatus.RECOVERING, reason=job.queue_reason)

    def _apply_report(self, job: JobRecord, report: AgentJobReport) -> None:
        now = self._clock()
        mark = self._memory.setdefault(job.id, MemoryMark())
        effects = apply_report(job, report, now, mark, self._memory_event_interval_s)
        with self.store.transaction():
            for ckpt in effects.checkpoints:
                self.store.add_checkpoint(job.id, ckpt)
            self.store.delete_checkpoints(job.id, effects.pruned)
            for t, kind, data in effects.events:
                self.store.add_event(job.id, t, kind, data)
            if effects.move is not None:
                self._move(job, effects.move[0], reason=effects.move[1])
            job.updated_at = now
            self.store.put_job(job, metrics_offset=report.next_offset)

    def _finish(self, job: JobRecord, ex: ExitInfo) -> None:
        planned = int((job.plan or {}).get("host_bytes") or 0)
        out = exit_outcome(ex, job.status, planned, job.node_id)
        if out.status is JobStatus.RECOVERING and out.retry:
            job.retries += 1
            if job.retries > MAX_RETRIES:
                assert out.code is not None, "exit_outcome names the cause of every retried exit"
                self._fail(job, out.code, f"{out.reason}; it was started {job.retries} times in a row without "
                                          "completing a step, and is not retried again", **out.data)
                return
            self._lost(job, out.reason, retry_after_s=retry_pause_s(job.retries))
        elif out.status is JobStatus.RECOVERING:
            self._lost(job, out.reason, retry_after_s=out.retry_after_s)
        elif out.status is JobStatus.FAILED:
            assert out.code is not None, "exit_outcome names the cause of every failure"
            self._fail(job, out.code, out.reason, **out.data)
        else:
            self._move(job, out.status, reason=out.reason, data=out.data)

    # ---- queue ---------------------------------------------------------------------------------------

    def _schedule(self, agents: Mapping[str, Agent]) -> None:
        infos = {n.node_id: n for n in self._alive_infos()}
        usage: dict[str, _Usage] = {}
        for job in self.store.jobs(statuses=(*ACTIVE, JobStatus.RECOVERING)):
            u = usage.setdefault(job.tenant, _Usage())
            u.jobs += 1
            u.bytes += int((job.plan or {}).get("host_bytes") or 0)
        order = fair_order(self.store.jobs(statuses=WAITING), self._last_served)
        still_waiting: list[tuple[JobRecord, str]] = []
        claims: dict[str, _Claim] = {}  # node -> the earliest job in fair order that waits for it
        for job in order:
            u = usage.setdefault(job.tenant, _Usage())
            reason = self._try_place(job, u, infos, agents, claims)
            if reason is not None:
                still_waiting.append((job, reason))
                if job.status is JobStatus.QUEUED and u.blocked_by is None:
                    u.blocked_by = job.id
        for position, (job, reason) in enumerate(still_waiting, start=1):
            if job.queue_position != position or job.queue_reason != reason:
                if _COUNTDOWN.sub("", reason) != _COUNTDOWN.sub("", job.queue_reason or ""):
                    log.info("job %s (tenant %s, %s) waits, position %d: %s", job.id, job.tenant, job.status.value,
                             position, reason)
                job.queue_position, job.queue_reason = position, reason
                self.store.put_job(job)

    def _try_place(self, job: JobRecord, u: _Usage, infos: dict[str, NodeInfo],
                   agents: Mapping[str, Agent], claims: dict[str, _Claim] | None = None) -> str | None:
        """Start `job` on its best node, or return why it waits. `claims`: nodes that earlier jobs in fair order
        wait for; `job` may use one only where it leaves the claimant what it waits for (so that a stream of
        small jobs cannot starve a large one: a job of several GPUs, or of much RAM), and claims one itself
        when it has to wait."""
        claims = {} if claims is None else claims
        quota = self.tenants.quota(job.tenant)
        if job.status is JobStatus.QUEUED and u.blocked_by is not None:
            return f"behind job {u.blocked_by} of the same tenant"
        not_before = self._not_before.get(job.id)
        if not_before is not None:
            if self._clock() < not_before:
                return f"{self._cause(job)}; retrying in {not_before - self._clock():.0f} s"
            del self._not_before[job.id]
        try:
            cands = evaluate(job.spec, infos.values(), self._planner, self._plan_cache, job.id)
        except InvalidSpec as exc:  # e.g. the model path is gone: no node will ever plan it
            self._fail(job, ErrorCode.INVALID_SPEC, exc.message)
            return None
        if not cands:
            return "no node is available"
        fitting = [c for c in cands if c.fits]
        if not fitting:
            if job.status is JobStatus.QUEUED:
                # queued while no node was known; now the nodes are known and none can ever hold it
                self._fail(job, ErrorCode.REJECTED, never_fits_reason(cands), nodes=per_node_reasons(cands))
                return None
            return f"{self._cause(job)}; no alive node can hold it now"
        if job.status is JobStatus.QUEUED:
            if u.jobs >= quota.max_concurrent_jobs:
                return (f"tenant {job.tenant} is at its quota of {quota.max_concurrent_jobs} concurrent "
                        "jobs")
            within = [c for c in cands if not c.fits or u.bytes + c.host_bytes <= quota.max_reserved_bytes]
            if not any(c.fits for c in within):
                need = min(c.host_bytes for c in fitting)
                return (f"tenant {job.tenant} would hold {format_bytes(u.bytes + need)} of host RAM; "
                        f"its quota is {format_bytes(quota.max_reserved_bytes)}")
            cands = within  # the plan on each node differs: place only where the quota still holds
        cands = [_behind_claim(c, claims.get(c.node_id)) for c in cands]
        cands = [self._answering(c) for c in cands]
        best = best_fit(cands)
        if best is None:
            _claim(job, cands, claims)
            base = waiting_reason(cands)
            return base if job.status is JobStatus.QUEUED else f"{self._cause(job)}; {base}"
        agent = agents.get(best.node_id)
        if agent is None:
            return f"node {best.node_id} has no agent"
        assert job.output_dir is not None, "submit gives every job its output_dir"
        try:
            res = agent.start(Launch(job_id=job.id, tenant=job.tenant, spec=job.spec, output_dir=job.output_dir,
                                     host_bytes=best.host_bytes, gpu_bytes=best.gpu_bytes,
                                     attempt=job.attempts + 1, needs_gpu=best.needs_gpu, gpus=best.gpus,
                                     cpu_threads=job.cpu_threads))
        except (ReservationRefused, AgentUnavailable) as exc:
            return f"node {best.node_id} refused it: {exc}"
        except Exception as exc:  # noqa: BLE001 - the agent failed to launch it (e.g. output_dir not writable)
            self._fail(job, ErrorCode.START_FAILED, f"node {best.node_id} could not start it: "
                                                     f"{type(exc).__name__}: {last_line(str(exc))}")
            return None
        self._placed(job, best, u, infos, res)
        return None

    def _answering(self, c: Candidate) -> Candidate:
        """`c`, not placeable now on a node that did not answer this pass (alive still, until node_dead_after_s
        says otherwise): a start there would fail as the pass's calls did, or land on a node about to be lost. It
        still counts as a node that can hold the job."""
        st = self._nodes.get(c.node_id)
        if st is None or st.failed_since is None or not c.fits_now:
            return c
        return dataclasses.replace(c, fits_now=False, reason=f"node {c.node_id} did not answer its last call")

    def _fail(self, job: JobRecord, code: ErrorCode, message: str, **data: Any) -> None:
        """The job ends FAILED with this cause; `data` goes into its status event beside the error."""
        job.error = JobError(code.value, message)
        self._move(job, JobStatus.FAILED, reason=message,
                   data={**data, "error": {"code": code.value, "message": message}})

    def _placed(self, job: JobRecord, best: Candidate, u: _Usage, infos: dict[str, NodeInfo],
                res: Reservation) -> None:
        was_waiting = job.status is JobStatus.QUEUED
        resumed = job.status is JobStatus.RECOVERING
        now = self._clock()
        job.node_id, job.plan, job.gpu_index = best.node_id, best.plan, res.gpu_index
        job.gpu_indices = list(res.gpu_indices)
        job.cpu_threads = job.cpu_threads or res.cpu_threads  # pinned by the first attempt
        job.attempts += 1
        job.started_at = job.started_at or now
        job.queue_reason = job.queue_position = None
        gpu = f", GPU{'s' if len(res.gpu_indices) > 1 else ''} {','.join(map(str, res.gpu_indices))}" \
            if res.gpu_indices else ""
        reason = f"placed on node {best.node_id} ({format_bytes(best.host_bytes)} host RAM reserved{gpu})"
        if resumed:
            ckpt = job.last_checkpoint_step
            reason = f"resumed on node {best.node_id}{gpu} from " + (
                f"checkpoint step {ckpt}" if ckpt is not None else "the start")
        self._move(job, JobStatus.RUNNING, reason=reason, data={"node_id": best.node_id,
                                                                 "host_bytes": best.host_bytes,
                                                                 "gpu_index": res.gpu_index,
                                                                 "gpu_indices": list(res.gpu_indices)})
        if was_waiting:
            u.jobs += 1
            u.bytes += best.host_bytes
            self._serve_clock += 1
            self._last_served[job.tenant] = self._serve_clock
            with self.store.transaction():
                self.store.set_meta("last_served", self._last_served)
                self.store.set_meta("serve_clock", self._serve_clock)
        info = infos[best.node_id]
        info.ledger = [*info.ledger, res]
        info.reserved_bytes += best.host_bytes
        info.reserved_gpu_bytes += best.gpu_bytes
        self._nodes[best.node_id].info = _copy_info(info)  # nodes() shows it before the next report
        for key in [k for k in self._plan_cache if k[0] == job.id]:
            del self._plan_cache[key]

    # ---- admission -----------------------------------------------------------------------------------

    def _admit(self, job: JobRecord) -> None:
        """VALIDATING -> QUEUED, or raise JobRejected / QuotaExceeded."""
        cands = evaluate(job.spec, self._alive_infos(), self._planner)
        if cands and not any(c.fits for c in cands):
            raise JobRejected(never_fits_reason(cands), nodes=[c.summary() for c in cands])
        quota = self.tenants.quota(job.tenant)
        fitting = [c for c in cands if c.fits]
        if fitting:
            need = min(c.host_bytes for c in fitting)
            if need > quota.max_reserved_bytes:
                raise QuotaExceeded(
                    f"the job needs {format_bytes(need)} of host RAM; tenant {job.tenant}'s quota is "
                    f"{format_bytes(quota.max_reserved_bytes)}", limit="max_reserved_bytes")
            job.plan = (best_fit(cands) or max(fitting, key=lambda c: c.ram_bytes)).plan
        job.queue_reason = "waiting for the scheduler"
        self._move(job, JobStatus.QUEUED, reason="accepted")

    def _recover_on_start(self) -> None:
        """Re-validate jobs caught mid-submit; running jobs are reconciled by the first tick."""
        for job in self.store.jobs(statuses=(JobStatus.VALIDATING,)):
            try:
                job.spec = self._validate_spec(job.spec)
                self._admit(job)
            except (BadInput, InvalidSpec) as exc:
                self._fail(job, ErrorCode.INVALID_SPEC, str(exc))
            except (JobRejected, QuotaExceeded) as exc:
                self._fail(job, ErrorCode.REJECTED, exc.message)
        for job in self.store.jobs():
            self._last_created = max(self._last_created, job.created_at)

    # ---- helpers -------------------------------------------------------------------------------------

    def _move(self, job: JobRecord, dst: JobStatus, *, reason: str | None = None,
              data: dict[str, Any] | None = None) -> None:
        """Apply one state-machine transition, record its event and persist the job, atomically."""
        src = job.status
        assert can_transition(src, dst), f"{job.id}: {src.value} -> {dst.value} is not a transition"
        log.log(_LEVELS.get(dst, logging.INFO) if {src, dst} != _CHECKPOINT_TOGGLE else logging.DEBUG,
                "job %s (tenant %s): %s -> %s: %s", job.id, job.tenant, src.value, dst.value, reason)
        now = self._clock()
        job.status, job.updated_at = dst, now
        if dst.is_terminal():
            job.finished_at = now
            job.queue_reason = job.queue_position = None
            self._memory.pop(job.id, None)
            self._not_before.pop(job.id, None)
        if dst is not JobStatus.RECOVERING:
            self._causes.pop(job.id, None)
        with self.store.transaction():
            self.store.put_job(job)
            self.store.add_event(job.id, now, EventType.STATUS,
                                 {"from": src.value, "to": dst.value, "reason": reason, **(data or {})})

    def _owned(self, tenant: str, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id) if isinstance(job_id, str) else None
        if job is None or job.tenant != tenant:
            raise JobNotFound(f"no job {job_id!r}", job_id=job_id)
        return job

    def _check_tenant(self, tenant: str) -> None:
        try:
            check_tenant_name(tenant)
        except BadInput as exc:
            raise InvalidRequest(str(exc)) from None

    def _normalise(self, spec: dict[str, Any], tenant: str, job_id: str) -> dict[str, Any]:
        """The spec validated strictly (InvalidSpec names the fix), with its output_dir made absolute or,
        when it has none, set to `<jobs_root>/<tenant>/<job_id>` (a relative one lies in `<jobs_root>/<tenant>/`).
        The gate in front of the actor confines tenants' paths (`gate.py`); the core only refuses two live jobs
        writing to one directory."""
        if not isinstance(spec, dict):
            raise InvalidSpec("a job spec is a mapping (the YAML/JSON object `horizon-ray finetune` reads)")
        given = spec.get("output_dir")
        if given is not None and not isinstance(given, str):
            raise InvalidSpec("output_dir must be a string (a directory path)")
        default = self.jobs_root / tenant / job_id
        output_dir = str((self.jobs_root / tenant / Path(given).expanduser()).resolve()) if given else str(default)
        full = dict(spec, output_dir=output_dir)
        try:
            return self._validate_spec(full)
        except BadInput as exc:
            raise InvalidSpec(exc.message, **({"field": exc.field} if exc.field else {})) from None

    def _created_time(self) -> float:
        # Strictly increasing, so that submit order is FIFO order even when the clock does not move.
        now = max(self._clock(), self._last_created + 1e-6)
        self._last_created = now
        return now

    def _agents(self) -> Mapping[str, Agent]:
        src = self._agents_source
        return src() if callable(src) else src

    def _alive_infos(self) -> builtins.list[NodeInfo]:
        return [_copy_info(st.info) for st in self._nodes.values() if st.alive and st.info is not None]


def _check_budget(spec: dict[str, Any], tenant: str, quota: TenantQuota) -> None:
    """QuotaExceeded when the job would take more optimizer steps or tokens than its tenant may spend on one."""
    if quota.max_steps_per_job is None and quota.max_tokens_per_job is None:
        return
    t = spec_section(spec, "training", TrainingSpec)  # the spec's defaults, never ones of its own
    steps = t.max_steps
    caps = [f"{quota.max_steps_per_job} steps" if quota.max_steps_per_job is not None else None,
            f"{quota.max_tokens_per_job} tokens" if quota.max_tokens_per_job is not None else None]
    budget = " and ".join(c for c in caps if c)
    if steps is None:
        raise QuotaExceeded(f"tenant {tenant} may spend at most {budget} on one job, and a job with only "
                            "training.epochs has no step count until its data is read; set training.max_steps",
                            limit="max_steps_per_job", field="training.max_steps")
    if quota.max_steps_per_job is not None and steps > quota.max_steps_per_job:
        raise QuotaExceeded(f"training.max_steps is {steps}; tenant {tenant} may run at most "
                            f"{quota.max_steps_per_job} steps a job: lower it", limit="max_steps_per_job",
                            field="training.max_steps")
    per_step = t.seq_len * t.micro_batch_size * t.grad_accum * gpus_wanted(spec)
    if quota.max_tokens_per_job is not None and steps * per_step > quota.max_tokens_per_job:
        raise QuotaExceeded(f"the job would train on {steps * per_step} tokens ({steps} steps of {per_step}); "
                            f"tenant {tenant} may spend at most {quota.max_tokens_per_job} on one job: lower "
                            "training.max_steps (or the tokens of a step)", limit="max_tokens_per_job",
                            field="training.max_steps")


def _training_view(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in _NOT_TRAINING_KEYS}


def _copy_info(info: NodeInfo) -> NodeInfo:
    return NodeInfo(**{**info.__dict__, "ledger": builtins.list(info.ledger)})


def _replace_alive(info: NodeInfo, alive: bool) -> NodeInfo:
    out = _copy_info(info)
    out.alive = alive
    return out


