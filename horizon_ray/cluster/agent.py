"""The node agent: one per node; runs each job's engine in a child process it supervises.

The agent owns its node's reservation ledger. `start` reserves the planner's bytes and, for a GPU job, one
of the node's GPUs, and launches `python -m horizon_ray.job --config <output_dir>/job.yaml --resume`;
a monitor thread samples the child's memory and reaps it, freeing the reservation (RAM and GPU) however
the child ends (exit, crash, signal, cancel).

Several engines run side by side on one node, one per GPU, all drawing on the one RAM ledger. Each child
sees only its GPU (CUDA_VISIBLE_DEVICES=<its index>, CUDA_DEVICE_ORDER=PCI_BUS_ID so that the index is
nvidia-smi's; "" for a CPU job) and gets its share of the node's cores (see `Ledger.cpu_share`) as
OMP_NUM_THREADS / MKL_NUM_THREADS and HORIZON_RAY_OPTIMIZER_THREADS (the threads its CPU AdamW should use).
The node's cores are its CPU limit where it has one (`node_cpu_count`: a pod's limit through the downward
API or the cgroup's quota), not the host's. A thread variable given explicitly in the agent's `env` (the Ray
wrapper puts there the ones the node's container sets) wins over the share.

The RAM offered to jobs is the node's (a pod's memory limit) less what Ray itself takes in the same
container, `ray_reserved_bytes` (its object store and its processes): the engines share the limit with them.

`drain` (a pod's preStop hook, `horizon-ray drain`) refuses new jobs and asks every engine to write a
checkpoint at the end of its current step and stop (SIGUSR1, exit 143), so that a pod deletion or a node
drain loses no work: the coordinator resumes the jobs elsewhere from those checkpoints.

The coordinator polls: `poll` returns the new events of each job (its metrics.jsonl, decoded with
`horizon_ray.job.events`, from the byte offset the coordinator acknowledged, so nothing is lost or repeated
across a coordinator restart) and how each finished job exited. A crash or OOM kill of a job is a child
exit: it never takes the agent down.

Children get PR_SET_PDEATHSIG=SIGKILL: when the agent dies (its node is removed, the actor is killed) its
jobs die with it. An agent that outlives its node (its raylet killed: the agent re-parented, still running) or
is cut off from the coordinator stops its engines itself: every poll renews its lease with the coordinator, and
`lease_s` after the last one it stops them (SIGTERM, SIGKILL `kill_grace_s` later). Each engine is also fenced
by its job's lease on the output directory (`horizon_ray.job.lease`): the agent grants it the epoch of its
start before it runs, and an engine whose job was recovered elsewhere or cancelled stops at its next step and
writes nothing more.

Engines start from an allow-list of the agent's environment (`engine_env`): never the API's variables
(`HORIZON_API_*`: the tenants' keys and their file) nor Ray's token.

When an engine dies of SIGKILL, its `ExitInfo` carries the evidence the coordinator needs to call it an OOM
kill or not: the OOM kills the kernel counted while it ran (machine-wide and in this node's memory cgroup),
the least memory the node had available, and the engine's peak RSS.

This module imports no Ray; `ray_actors` turns `NodeAgent` into a Ray actor pinned to its node. It is the
process supervision; the protocol the coordinator uses is `agent_protocol`, the ledger `ledger`, the node's GPUs
`gpus` and what its kernel and cgroup say (RAM, cores, available memory, OOM kills) `cgroups`.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from horizon_ray.atomic import write_atomic
from horizon_ray.cluster import placement
from horizon_ray.cluster.agent_protocol import ENGINE_LEASE_S, ReservationRefused
from horizon_ray.cluster.cgroups import available_memory_bytes, node_cpu_count, node_ram_bytes, oom_kill_count
from horizon_ray.cluster.engine_env import SECRET_ENV_PREFIX, engine_base_env
from horizon_ray.cluster.gpus import detect_gpus
from horizon_ray.cluster.ledger import Ledger
from horizon_ray.cluster.messages import AgentJobReport, ExitInfo, Launch, NodeInfo, Reservation
from horizon_ray.job import lease
from horizon_ray.job.events import Event, decode
from horizon_ray.job.metrics import METRICS_FILE, SPEC_FILE

log = logging.getLogger("horizon_ray.cluster")
PROBE_TIMEOUT_S = 600  # a first probe on a busy machine, with the engine's imports
_MAX_LINES_PER_POLL = 2000
_STDERR_TAIL_BYTES = 4000


# Ray's own processes in a node besides its object store: raylet, dashboard agent, log monitor, runtime-env
# agent and this agent (measured: ~0.6 GiB on an idle node; 1 GiB leaves room for their growth).
RAY_PROCESSES_BYTES = 1 << 30


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HORIZON_RAY_OPTIMIZER_THREADS")


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    """`env` without the API's variables (SECRET_ENV_PREFIX)."""
    return {k: v for k, v in env.items() if not k.startswith(SECRET_ENV_PREFIX)}


def engine_env(res: Reservation, gpu_ids: list[str], fixed: dict[str, str] | None = None) -> dict[str, str]:
    """What a job's engine gets on top of the agent's environment: only its GPUs, its share of the cores.

    `gpu_ids`: the CUDA_VISIBLE_DEVICES value of each of the node's GPUs, by ledger index. `fixed`: the
    agent's explicit environment; a thread variable (or CUDA_DEVICE_ORDER) set there is left as it is.
    """
    fixed = fixed or {}
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids[i] for i in res.gpu_indices)}
    if res.gpu_index is not None and "CUDA_DEVICE_ORDER" not in fixed:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's own order may differ from nvidia-smi's indices
    if res.cpu_threads:
        # On CUDA the engine's own rule keeps two cores for the training thread's kernel launches.
        optimizer = res.cpu_threads - 2 if res.gpu_index is not None and res.cpu_threads > 2 else res.cpu_threads
        shares = dict(zip(THREAD_VARS, (res.cpu_threads, res.cpu_threads, optimizer), strict=True))
        env.update({k: str(v) for k, v in shares.items() if k not in fixed})
    return env


def read_new_events(path: Path, offset: int) -> tuple[list[Event], int]:
    """The events of the complete lines of a metrics.jsonl from byte `offset`; returns (events, next offset).

    A torn last line (no newline yet) is left for the next read. A line that is not an event (the tail of a
    killed writer followed by a resumed one) is skipped. A file shorter than `offset` was rewritten:
    reading restarts at 0.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], offset
    if size < offset:
        offset = 0
    events: list[Event] = []
    with open(path, "rb") as f:
        f.seek(offset)
        while len(events) < _MAX_LINES_PER_POLL:
            raw = f.readline()
            if not raw.endswith(b"\n"):
                break
            offset += len(raw)
            try:
                event = decode(json.loads(raw))
            except ValueError:
                continue
            if event is not None:
                events.append(event)
    return events, offset


_LIBC: ctypes.CDLL | None
try:  # loaded once here: a dlopen between fork and exec in a threaded process can deadlock
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: no parent-death signal
    _LIBC = None


def _set_pdeathsig(parent: int) -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGKILL it when its parent dies, and exit if
    # the parent already died before the request took effect (then it would never come). SIGUSR1 (drain) is
    # blocked, so that it waits until the engine has installed its handler and unblocks it: its default action
    # would kill an engine still starting.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


@dataclass
class _Job:
    job_id: str
    proc: subprocess.Popen
    output_dir: Path
    log_path: Path
    epoch: int = 1  # the start of the job this engine is (its lease's epoch)
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    cancel_at: float | None = None  # when the cancel was asked (SIGTERM sent)
    stop_at: float | None = None  # when the agent stopped it itself (its lease with the coordinator ran out)
    exit: ExitInfo | None = None
    forgotten: bool = False  # killed by forget(): dropped (and its reservation released) once it is reaped
    oom_kills_at_start: int = 0  # oom_kill_count() when it started
    min_available_bytes: int | None = None  # the least memory the node had available while it ran


class NodeAgent:
    """Supervisor of the engine processes of one node."""

    def __init__(
        self,
        node_id: str,
        *,
        ram_bytes: int | None = None,
        gpu_count: int | None = None,
        gpu_memory_bytes: int | None = None,
        cpu_count: int | None = None,
        ray_node_id: str | None = None,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        sample_interval_s: float = 0.2,
        kill_grace_s: float = 10.0,
        ray_reserved_bytes: int = 0,
        lease_s: float = ENGINE_LEASE_S,
        probe: bool = False,
    ):
        """`gpu_count` None: the node's GPUs from nvidia-smi (see detect_gpus); a number declares logical
        GPUs 0..N-1 (simulated nodes). `cpu_count` None: the node's CPU limit (`node_cpu_count`). `ram_bytes`
        None: the node's RAM (`node_ram_bytes`) less `ray_reserved_bytes`, what Ray takes of it. `lease_s`: how
        long its engines outlive the coordinator's last call (0: forever). `probe`: measure the node's ceilings
        (`horizon-ray probe`, cached) in the background and report them with the node."""
        # A Ray worker inherits its raylet's environment: whatever the API's variables reached, they end here.
        for name in [k for k in os.environ if k.startswith(SECRET_ENV_PREFIX)]:
            del os.environ[name]
        env = without_secrets(dict(env or {}))
        if ram_bytes is None:
            total = node_ram_bytes({**os.environ, **env})
            ram_bytes = total - int(ray_reserved_bytes)
            if ram_bytes <= 0:
                raise ValueError(f"node {node_id} has {total} bytes of RAM (HORIZON_NODE_RAM_BYTES or its memory "
                                 f"limit) and Ray takes {ray_reserved_bytes} of them (object store and processes): "
                                 "nothing is left for jobs; raise the pod's memory limit or lower the Ray start "
                                 "parameter object-store-memory")
        if gpu_count is None:
            self._gpu_ids, detected_mem = detect_gpus({**os.environ, **env})
            gpu_memory_bytes = gpu_memory_bytes or detected_mem
        else:
            self._gpu_ids = [str(i) for i in range(int(gpu_count))]
        self.node_id = node_id
        self.ray_node_id = ray_node_id
        self.incarnation = uuid.uuid4().hex[:12]
        self._ledger = Ledger(
            ram_bytes=int(ram_bytes),
            gpu_count=len(self._gpu_ids),
            gpu_memory_bytes=int(gpu_memory_bytes or 0),
            cpu_count=int(cpu_count if cpu_count is not None else node_cpu_count({**os.environ, **env})),
        )
        # argv prefix of a job; `--config <spec> --resume` is appended
        self._command = list(command or [sys.executable, "-m", "horizon_ray.job"])
        self._env = env
        self._sample_interval_s = sample_interval_s
        self._kill_grace_s = kill_grace_s
        self._lease_s = lease_s
        self._heard = time.monotonic()  # the coordinator's last call
        self._jobs: dict[str, _Job] = {}
        self._draining = False  # set by drain(): no new job starts here
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"agent-{node_id}", daemon=True)
        self._monitor.start()
        self._ceilings: dict[str, Any] | None = None  # the probe's NodeInfo.ceilings, once it has run
        if probe:
            threading.Thread(target=self._probe, name=f"probe-{node_id}", daemon=True).start()

    # ---- the Agent interface -------------------------------------------------------------------------

    def info(self) -> NodeInfo:
        with self._lock:
            self._heard = time.monotonic()
            self._reap()
            return self._ledger.node_info(self.node_id, ray_node_id=self.ray_node_id,
                                          incarnation=self.incarnation, ceilings=self._ceilings,
                                          engine_lease_s=self._lease_s + self._kill_grace_s if self._lease_s else 0.0)

    def start(self, launch: Launch) -> Reservation:
        job_id = launch.job_id
        with self._lock:
            self._heard = time.monotonic()
            self._reap()
            if job_id in self._jobs and self._jobs[job_id].exit is None:
                return self._ledger.entries[job_id]  # already running here: a retried start
            if self._draining:
                raise ReservationRefused(f"node {self.node_id} is draining (its pod is stopping); job {job_id} "
                                         "goes to another node")
            self._jobs.pop(job_id, None)
            res = self._ledger.reserve(job_id, launch.host_bytes, launch.gpu_bytes,
                                       _needs_gpu(launch, self._ledger.gpu_count), tenant=launch.tenant,
                                       gpus=launch.gpus, cpu_threads=launch.cpu_threads)
            try:
                self._jobs[job_id] = self._launch(launch, res)
            except BaseException:
                self._ledger.release(job_id)
                raise
            return res

    def reserve_generation(self, key: str, host_bytes: int, gpu: bool, tenant: str | None = None) -> Reservation:
        """Set aside host RAM (and a GPU, on a GPU node) for a generation actor on this node (cluster/generation.py),
        in the same ledger as the jobs, so that the planner places jobs around it; ReservationRefused when the
        node has no room or is draining."""
        with self._lock:
            if self._draining:
                raise ReservationRefused(f"node {self.node_id} is draining; the model is loaded elsewhere")
            return self._ledger.reserve(key, host_bytes, 0, needs_gpu=gpu and self._ledger.gpu_count > 0,
                                        tenant=tenant)

    def release_generation(self, key: str) -> None:
        """The generation actor of ``key`` is gone: its reservation is free."""
        with self._lock:
            if key not in self._jobs:
                self._ledger.release(key)

    def cancel(self, job_id: str) -> None:
        with self._lock:
            self._heard = time.monotonic()
            self._reap()  # a job that already exited (0: its model is written) is not cancelled after the fact
            job = self._jobs.get(job_id)
            if job is None or job.exit is not None or job.cancel_at is not None:
                return
            job.cancel_at = time.time()
            # revoked first: when this returns, the engine writes nothing more, even before it exits
            try:
                lease.revoke(job.output_dir, job_id, job.epoch)
            except OSError as exc:  # its storage failing: the signal below still stops it
                print(f"agent {self.node_id}: could not revoke the lease of {job_id}: {exc}", file=sys.stderr)
            _signal_group(job.proc, signal.SIGTERM)

    def poll(self, offsets: dict[str, int]) -> dict[str, AgentJobReport]:
        """Reports of every job this agent holds (running, or exited and not yet forgotten)."""
        with self._lock:
            self._heard = time.monotonic()
            self._reap()
            reports = {}
            for job_id, job in self._jobs.items():
                if job.forgotten:
                    continue
                events, next_offset = read_new_events(job.output_dir / METRICS_FILE, int(offsets.get(job_id, 0)))
                reports[job_id] = AgentJobReport(
                    job_id=job_id,
                    events=events,
                    next_offset=next_offset,
                    rss_bytes=job.rss_bytes if job.exit is None else 0,
                    peak_rss_bytes=job.peak_rss_bytes,
                    exit=job.exit,
                )
            return reports

    def forget(self, job_id: str) -> None:
        """Drop an exited job (the coordinator has recorded its end). A running job is killed and dropped
        once it is reaped, its reservation held until then; the call does not wait for it (tearing down a
        large engine can take longer than a call may)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            if job.exit is None:
                job.forgotten = True
                _signal_group(job.proc, signal.SIGKILL)
                self._reap()
                if job.exit is None:
                    return
            self._jobs.pop(job_id, None)
            self._ledger.release(job_id)

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop every job (the service is stopping) and the monitor: SIGTERM, then SIGKILL after the grace
        period, so that engines exit as interrupted (143, resumable) where they can."""
        grace_s = self._kill_grace_s if grace_s is None else grace_s
        with self._lock:
            running = [job for job in self._jobs.values() if job.exit is None]
            for job in running:  # not a cancel: the engines stop resumably and their jobs resume elsewhere
                _signal_group(job.proc, signal.SIGTERM)
            deadline = time.time() + grace_s
            for job in running:
                try:
                    job.proc.wait(timeout=max(0.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    _signal_group(job.proc, signal.SIGKILL)
                    job.proc.wait()
            self._reap()
        self._stop.set()

    def drain(self) -> list[str]:
        """Take no new job and ask every running engine to checkpoint at the end of its current step and stop
        (SIGUSR1; it exits 143, resumable). Returns the ids of the engines still running; `running` follows them."""
        with self._lock:
            self._draining = True
            self._reap()
            running = [job for job in self._jobs.values() if job.exit is None]
            for job in running:
                try:
                    os.kill(job.proc.pid, signal.SIGUSR1)  # the engine only: its helpers stop with it
                except ProcessLookupError:
                    pass
            return [job.job_id for job in running]

    def running(self) -> list[str]:
        """The ids of the jobs whose engine has not exited."""
        with self._lock:
            self._reap()
            return [job.job_id for job in self._jobs.values() if job.exit is None]

    def ping(self) -> str:
        return self.incarnation

    # ---- internals -----------------------------------------------------------------------------------

    def _probe(self) -> None:
        """Run `horizon-ray probe --json` (cached per machine) in a child, with the threads a CPU job alone on
        this node gets: the agent never imports torch. A failure leaves the planner's defaults (labelled
        assumed in every plan) and is logged."""
        env = {**os.environ, **self._env}
        if self._ledger.cpu_count:
            env.update({k: str(self._ledger.cpu_count) for k in THREAD_VARS[:2] if k not in self._env})
        try:
            out = subprocess.run([sys.executable, "-m", "horizon_ray", "probe", "--json"], env=env,
                                 capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True,
                                 stdin=subprocess.DEVNULL)
            from horizon_ray.probe import Probe

            probe = Probe.from_dict(json.loads(out.stdout))
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            tail = getattr(exc, "stderr", "") or ""
            log.warning("node %s: probing its ceilings failed (%s%s); its jobs are planned with the defaults",
                        self.node_id, type(exc).__name__, f": {tail.strip()[-300:]}" if tail else "")
            return
        with self._lock:
            self._ceilings = probe.wire()

    def _launch(self, launch: Launch, res: Reservation) -> _Job:
        job_id, output_dir = launch.job_id, Path(launch.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        spec = dict(launch.spec, output_dir=str(output_dir))
        engine = spec.get("engine")
        if isinstance(engine, dict) and str(engine.get("device", "")).startswith("cuda:"):
            # The agent picks the GPU; the child sees only that one, as cuda:0.
            spec["engine"] = dict(engine, device="cuda")
        spec_path = output_dir / SPEC_FILE
        write_atomic(spec_path, yaml.safe_dump(spec, sort_keys=False).encode())
        log_dir = output_dir / "logs"
        log_dir.mkdir(exist_ok=True)
        log_path = log_dir / f"attempt-{launch.attempt}-{self.node_id}.log"
        env = engine_base_env(os.environ, self._env)  # an allow-list: no key, no token reaches a tenant's job
        env[lease.ENV_JOB] = job_id
        env[lease.ENV_EPOCH] = str(launch.attempt)
        env["HORIZON_RAY_NODE_ID"] = self.node_id
        env.update(engine_env(res, self._gpu_ids, self._env))
        argv = [*self._command, "--config", str(spec_path), "--resume"]
        # The lease is this start's before the engine runs: an earlier engine of the job stops at its next step.
        lease.grant(output_dir, job_id, launch.attempt, self.node_id)
        oom_kills = oom_kill_count()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=str(output_dir), start_new_session=True,
                                    preexec_fn=functools.partial(_set_pdeathsig, os.getpid()))
        return _Job(job_id=job_id, proc=proc, output_dir=output_dir, log_path=log_path, epoch=launch.attempt,
                    oom_kills_at_start=oom_kills)

    def _reap(self) -> None:
        """Record the exit of finished children and free their reservations. Caller holds the lock."""
        now = time.time()
        for job in list(self._jobs.values()):
            if job.exit is not None:
                continue
            try:  # has the leader exited? (left a zombie, so that its group id cannot be reused yet)
                exited = os.waitid(os.P_PID, job.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            except ChildProcessError:
                exited = True
            if not exited:
                asked = job.cancel_at if job.cancel_at is not None else job.stop_at
                if asked is not None and now - asked > self._kill_grace_s:
                    _signal_group(job.proc, signal.SIGKILL)
                continue
            # whatever the engine started in its session dies with it: nothing may outlive the reservation
            _signal_group(job.proc, signal.SIGKILL)
            rc = job.proc.wait()
            job.exit = ExitInfo(returncode=rc, cancelled=job.cancel_at is not None and rc != 0,
                                peak_rss_bytes=job.peak_rss_bytes, stderr_tail=_tail(job.log_path), time=now,
                                oom_kills=max(0, oom_kill_count() - job.oom_kills_at_start),
                                min_available_bytes=job.min_available_bytes, ram_bytes=self._ledger.ram_bytes)
            self._ledger.release(job.job_id)
            if job.forgotten:
                self._jobs.pop(job.job_id, None)

    def _sample(self) -> None:
        running = [job for job in self._jobs.values() if job.exit is None]
        available = available_memory_bytes() if running else 0
        for job in running:
            job.min_available_bytes = available if job.min_available_bytes is None else \
                min(job.min_available_bytes, available)
            try:
                p = psutil.Process(job.proc.pid)
                rss = p.memory_info().rss
                children = p.children(recursive=True)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            for c in children:
                try:
                    # a forked child's pages are the engine's until written: only its own (USS) count
                    rss += c.memory_full_info().uss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
            job.rss_bytes = rss
            job.peak_rss_bytes = max(job.peak_rss_bytes, rss)

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self._sample_interval_s):
            with self._lock:
                self._sample()
                self._fence()
                self._reap()

    def _fence(self) -> None:
        """Stop every engine once the coordinator has not called for `lease_s`: it may have recovered them on
        another node (this node cut off, or its raylet gone while this process lives on). Caller holds the lock."""
        if not self._lease_s or time.monotonic() - self._heard <= self._lease_s:
            return
        for job in self._jobs.values():
            if job.exit is None and job.stop_at is None and job.cancel_at is None:
                job.stop_at = time.time()
                _signal_group(job.proc, signal.SIGTERM)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _needs_gpu(launch: Launch, gpu_count: int) -> bool:
    """The coordinator's decision, or the rule of `placement.needs_gpu` on the spec."""
    return placement.needs_gpu(launch.spec, gpu_count) if launch.needs_gpu is None else launch.needs_gpu


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _STDERR_TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
