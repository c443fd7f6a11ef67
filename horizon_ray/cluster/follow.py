"""Submit a spec to the coordinator and follow it to the end: the Ray Jobs CLI path and `submit --follow`.

`ray job submit -- horizon-ray finetune --config job.yaml` runs `horizon-ray finetune` as the Ray job's
entrypoint on the head node. When a coordinator runs in that cluster, finetune must not train in the
entrypoint process: it hands the spec to the coordinator (which places it on the node that fits, like any
other job, and shows it in the same job list) and follows it, exiting 0 when it succeeds and non-zero
otherwise. The hook for `horizon_ray.commands.finetune.run`::

    from horizon_ray.cluster import should_submit_to_coordinator, submit_and_follow
    if should_submit_to_coordinator():
        return submit_and_follow(spec.to_dict())

Decision (`should_submit_to_coordinator`): HORIZON_RAY_SUBMIT=1 forces it, HORIZON_RAY_SUBMIT=0 forbids
it (the node agent sets 0 for the engine processes it starts, so they never loop back); otherwise it
submits when running as a Ray Jobs entrypoint (RAY_JOB_CONFIG_JSON_ENV_VAR is set) and the cluster has a
coordinator.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from horizon_ray.cluster.client import CoordinatorClient
from horizon_ray.cluster.errors import CoordinatorUnavailable, HorizonError
from horizon_ray.cluster.messages import EventType, JobEvent, JobRecord, JobStatus
from horizon_ray.job.progress import format_rewards

RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray Jobs for the entrypoint process only


def ray_job_submission_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray Jobs submission id of this entrypoint process, if it is one."""
    env = os.environ if environ is None else environ
    raw = env.get(RAY_JOB_ENV)
    if not raw:
        return None
    try:
        return (json.loads(raw).get("metadata") or {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None


def job_server_cluster(pid: int | None = None) -> str | None:
    """The GCS address of the cluster whose job server started this Ray job's entrypoint: the one its job
    supervisor (an ancestor process, a Ray worker started with --gcs-address) belongs to. None outside a Ray job.

    Not RAY_ADDRESS: Ray sets it to the newest cluster of the supervisor's temp dir, which is another cluster
    when another one started later on the machine (another serve, a test's)."""
    import psutil

    try:
        proc: psutil.Process | None = psutil.Process(pid or os.getpid())
        while proc is not None:
            for arg in proc.cmdline():
                if arg.startswith("--gcs-address="):
                    return arg.split("=", 1)[1]
            proc = proc.parent()
    except (psutil.Error, OSError):
        return None
    return None


def entrypoint_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray address a Ray job's entrypoint reaches the service at: its job server's cluster."""
    env = os.environ if environ is None else environ
    return job_server_cluster() or env.get("RAY_ADDRESS")


def should_submit_to_coordinator(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `horizon-ray finetune` should submit its spec to the coordinator (see the module doc)."""
    env = os.environ if environ is None else environ
    flag = (env.get("HORIZON_RAY_SUBMIT") or "").strip().lower()
    if flag:
        return flag in ("1", "true", "yes", "on")
    if RAY_JOB_ENV not in env:
        return False
    return coordinator_reachable(entrypoint_address(env))


def coordinator_reachable(address: str | None = None) -> bool:
    """True when the Ray cluster at `address` (default: auto) runs a coordinator."""
    try:
        from horizon_ray.cluster.client import RayClient

        return RayClient(address).ready()
    except Exception:  # noqa: BLE001 - no Ray, no cluster, no coordinator: all mean "no"
        return False


def submit_and_follow(
    spec: dict[str, Any],
    *,
    tenant: str | None = None,
    name: str | None = None,
    priority: int = 0,
    idempotency_key: str | None = None,
    address: str | None = None,
    client: CoordinatorClient | None = None,
    poll_s: float = 1.0,
    out: TextIO | None = None,
) -> int:
    """Submit `spec` and print its progress until it ends. Returns the process exit code:
    0 succeeded, 1 failed or cancelled, 2 refused (invalid spec, rejected, over quota), 130 interrupted
    (the job is cancelled first: `ray job stop` sends SIGTERM, which lands here).

    Without a `client`, the job acts as the tenant of the API key in $HORIZON_API_KEY (a Ray job's runtime env
    sets it), which the coordinator verifies; `tenant` is for a given client only. idempotency_key: default
    the Ray job's submission id, so a retried entrypoint follows the same job instead of submitting a second
    one.
    """
    from horizon_ray.cluster.gate import ENV_API_KEY

    out = out or sys.stdout
    ray_job = ray_job_submission_id()
    if idempotency_key is None and ray_job:
        idempotency_key = f"ray-job:{ray_job}"
    try:
        if client is None:
            from horizon_ray.cluster.client import RayClient

            client = RayClient(address or entrypoint_address(), credential=os.environ.get(ENV_API_KEY) or None)
            tenant = client.whoami()
        tenant = tenant or "default"
        job = client.submit(tenant, spec, idempotency_key=idempotency_key, priority=priority,
                            name=name or spec.get("name") or ray_job)
    except HorizonError as exc:
        print(format_refusal(exc), file=sys.stderr)
        return 2
    print(f"submitted job {job.id} (tenant {tenant}); output in {job.output_dir}", file=out, flush=True)
    return follow(client, tenant, job.id, poll_s=poll_s, out=out)


def follow(client: CoordinatorClient, tenant: str, job_id: str, *, poll_s: float = 1.0,
           out: TextIO | None = None, cancel_on_interrupt: bool = True) -> int:
    """Print the job's events until it ends; exit code as in `submit_and_follow`."""
    out = out or sys.stdout
    seq = 0
    throttle = _Throttle()

    def print_new_events() -> None:
        nonlocal seq
        for event in client.events(tenant, job_id, after_seq=seq):
            seq = event.seq
            line = format_event(event)
            if line and throttle.show(event):
                print(line, file=out, flush=True)

    restore = _sigterm_as_interrupt()
    try:
        while True:
            try:
                print_new_events()
                job = client.get(tenant, job_id)
                if job.status.is_terminal():
                    print_new_events()  # those written between the two calls above
                    return _final(job, out)
            except CoordinatorUnavailable as exc:
                # The coordinator restarts after a crash and reloads its table: keep following.
                print(f"waiting for the coordinator: {exc.message}", file=out, flush=True)
                time.sleep(max(poll_s, 2.0))
                continue
            time.sleep(poll_s)
    except KeyboardInterrupt:
        if not cancel_on_interrupt:
            return 130
        print(f"interrupted: cancelling job {job_id}", file=out, flush=True)
        try:
            client.cancel(tenant, job_id)
        except HorizonError as exc:
            print(f"error: could not cancel {job_id}: {exc.message}", file=sys.stderr)
        return 130
    finally:
        restore()


def format_refusal(exc: HorizonError) -> str:
    """A refused submit for a terminal: the error line, then each node's verdict on its own line when the
    refusal carries them (a job no node can ever hold)."""
    lines = [f"error: {exc.message}"]
    for node in exc.details.get("nodes") or []:
        if isinstance(node, dict) and node.get("reason"):
            lines.append(f"  node {node.get('node_id')}: {node['reason']}")
    return "\n".join(lines)


def format_loss(value: Any) -> str:
    """A loss for a terminal; metrics.jsonl writes a non-finite one as null, shown as nan."""
    return f"{value:.4f}" if isinstance(value, (int, float)) else "nan"


def format_event(event: JobEvent) -> str | None:
    """One line for a terminal, or None for events not worth a line: a step with its place in the run, its
    throughput and the time left, memory in GiB."""
    d = event.data
    if event.type is EventType.STATUS:
        reason = f" ({d['reason']})" if d.get("reason") else ""
        return f"[{event.job_id}] {d.get('from') or '-'} -> {d.get('to')}{reason}"
    if event.type is EventType.METRICS:
        if "eval_loss" in d:
            rewards = format_rewards(d.get("eval_preference"))
            return (f"[{event.job_id}] step {d.get('step')}: eval loss {format_loss(d['eval_loss'])}"
                    + (f", {rewards}" if rewards else ""))
        if "loss" in d:
            return f"[{event.job_id}] {format_progress(d)}"
        return None
    if event.type is EventType.CHECKPOINT:
        return f"[{event.job_id}] checkpoint at step {d.get('step')}: {d.get('path')}"
    if event.type is EventType.MEMORY:
        return f"[{event.job_id}] {format_memory(d)}"
    if event.type is EventType.ERROR:
        return f"[{event.job_id}] error: {d.get('message')}"
    return None


def format_progress(d: dict[str, Any]) -> str:
    """ "step 21/400: loss 1.9747, 7,685 tokens/s, ETA 0:48" from a metrics event's data."""
    from horizon_ray.job.progress import format_eta

    total = f"/{d['total_steps']}" if d.get("total_steps") else ""
    parts = [f"step {d.get('step')}{total}: loss {format_loss(d.get('loss'))}"]
    rewards = format_rewards(d.get("preference"))
    if rewards:
        parts.append(rewards)
    if isinstance(d.get("tokens_per_s"), int | float):
        parts.append(f"{d['tokens_per_s']:,.0f} tokens/s")
    if d.get("eta_s") is not None:
        parts.append(f"ETA {format_eta(d['eta_s'])}")
    return ", ".join(parts)


def format_memory(d: dict[str, Any]) -> str:
    """ "host memory 1.2 GiB now, peak 1.4 GiB, 2.0 GiB planned" from a memory event's data."""
    from horizon_ray.cluster.tenants import format_bytes

    planned = f", {format_bytes(d['planned_bytes'])} planned" if d.get("planned_bytes") else ""
    return f"host memory {format_bytes(d.get('rss_bytes'))} now, peak {format_bytes(d.get('peak_rss_bytes'))}{planned}"


class _Throttle:
    """Which metrics lines a follower prints: about one in twenty of a run's steps and its last, as the local
    progress does; every other event."""

    def __init__(self) -> None:
        self.last = -1

    def show(self, event: JobEvent) -> bool:
        d = event.data
        if event.type is not EventType.METRICS or "loss" not in d or not isinstance(d.get("step"), int):
            return True
        total = d.get("total_steps") if isinstance(d.get("total_steps"), int) else None
        every = max(1, total // 20) if total else 1
        if self.last < 0 or d["step"] - self.last >= every or d["step"] == total:
            self.last = d["step"]
            return True
        return False


def _final(job: JobRecord, out: TextIO) -> int:
    if job.status is JobStatus.SUCCEEDED:
        print(f"job {job.id} succeeded; final model in {job.output_dir}/final", file=out, flush=True)
        return 0
    if job.status is JobStatus.CANCELLED:
        print(f"job {job.id} was cancelled", file=sys.stderr)
        return 1
    err = job.error.message if job.error else "unknown error"
    print(f"error: job {job.id} failed: {err}", file=sys.stderr)
    return 1


def _sigterm_as_interrupt():
    """While following, SIGTERM (`ray job stop`) raises KeyboardInterrupt so the job gets cancelled."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)
