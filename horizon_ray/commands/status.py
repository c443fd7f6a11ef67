"""``horizon-ray status [JOB_ID]``: the service at a glance, or one job.

Without a job id: the nodes (RAM, reservations, jobs, GPUs busy of all), the tenant's recent jobs and the
queue. With one: the job's state, node and GPU, progress, plan, error, checkpoints and latest events; the
exit code is 1 when the job failed or was cancelled, else 0 (2 when it does not exist or the service is
unreachable).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

from horizon_ray.commands.submit import add_connection_arguments, connect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", nargs="?", default=None, metavar="JOB_ID", help="one job (default: all)")
    add_connection_arguments(parser)
    parser.add_argument("--limit", type=int, default=20, help="jobs to list (default 20)")
    parser.add_argument("--events", type=int, default=10, help="latest events to show for one job")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


# how long `status --address HOST:PORT` waits for the address to answer before it says so (Ray itself retries the
# GCS for minutes, printing its warnings)
CONNECT_TIMEOUT_S = 5.0


def run(args: argparse.Namespace) -> int:
    from horizon_ray.cluster.errors import HorizonError

    if args.address and (silent := _unanswered(args.address)):
        print(f"error: no Ray cluster answers at {args.address} ({silent}, within {CONNECT_TIMEOUT_S:.0f} s); "
              "check --address: serve prints its cluster's ('clients: horizon-ray submit JOB.yaml --address ...'), "
              "or leave it out to use the service of --root", file=sys.stderr)
        return 2
    try:
        client, tenant = connect(args)
        if args.job_id:
            return _one(client, tenant, args)
        return _overview(client, tenant, args)
    except HorizonError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


def _unanswered(address: str) -> str | None:
    """Why nothing listens at a HOST:PORT (or ray://HOST:PORT) address, or None when something does (or the
    address is Ray's "auto", which Ray resolves)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns as wide as their widest cell (a long node id or name shifts nothing), two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _overview(client, tenant: str, args) -> int:
    from horizon_ray.cluster.tenants import format_bytes
    from horizon_ray.job.progress import format_eta

    nodes = client.nodes()
    jobs, more = client.list(tenant, limit=args.limit)
    queue = client.queue(tenant)
    if args.json:
        print(json.dumps({"nodes": [n.to_dict() for n in nodes], "jobs": [j.to_dict() for j in jobs],
                          "has_more": more, "queue": [j.to_dict() for j in queue]}, indent=2))
        return 0
    rows: list[tuple[str, ...]] = [
        (n.node_id, format_bytes(n.ram_bytes), format_bytes(n.reserved_bytes), format_bytes(n.free_bytes),
         str(len(n.ledger)), "yes" if n.alive else "no", f"{len(n.busy_gpus)}/{n.gpu_count}" if n.gpu_count else "-")
        for n in nodes]
    print(table(("NODE", "RAM", "RESERVED", "FREE", "JOBS", "ALIVE", "GPUS BUSY"), rows))
    print(f"\nJOBS of tenant {tenant}")
    rows = []
    for j in jobs:
        p = j.progress
        step = str(p.step) + (f"/{p.total_steps}" if p.total_steps else "")
        live = not j.status.is_terminal()
        rows.append((j.id, j.status.value, j.node_id or "-", step,
                     f"{p.tokens_per_s:,.0f}" if p.tokens_per_s and live else "-",
                     format_eta(p.eta_s) if p.eta_s is not None and live else "-", _time(j.created_at),
                     j.name or ""))
    print(table(("ID", "STATUS", "NODE", "STEP", "TOKENS/S", "ETA", "CREATED", "NAME"), rows))
    if more:
        print("... more; use --limit")
    if queue:
        print("\nQUEUE")
        for j in queue:
            print(f"{j.queue_position or '-':>3}. {j.id} ({j.status.value}): {j.queue_reason}")
    return 0


def _one(client, tenant: str, args) -> int:
    from horizon_ray.cluster.follow import format_event, format_loss, format_memory, format_rewards
    from horizon_ray.cluster.tenants import format_bytes
    from horizon_ray.job.progress import format_eta

    job = client.get(tenant, args.job_id)
    events = client.events(tenant, job.id)
    checkpoints = client.checkpoints(tenant, job.id)
    if args.json:
        print(json.dumps({"job": job.to_dict(), "checkpoints": [c.__dict__ for c in checkpoints],
                          "events": [e.to_dict() for e in events[-args.events:]]}, indent=2))
    else:
        p = job.progress
        name = f"  name {job.name}" if job.name else ""
        print(f"{job.id}  {job.status.value}  tenant {job.tenant}{name}")
        gpus = job.gpus_held
        gpu = f"   gpu{'s' if len(gpus) > 1 else ''}: {','.join(map(str, gpus))}" if gpus else ""
        print(f"  node: {job.node_id or '-'}{gpu}   attempts: {job.attempts}   created {_time(job.created_at)}"
              + (f"   finished {_time(job.finished_at)}" if job.finished_at else ""))
        total = f"/{p.total_steps}" if p.total_steps else ""
        speed = f"   {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""
        eta = f"   ETA {format_eta(p.eta_s)}" if p.eta_s is not None and not job.status.is_terminal() else ""
        print(f"  step: {p.step}{total}{speed}{eta}")
        memory = [e for e in events if e.type.value == "memory"]
        if memory:
            print(f"  {format_memory(memory[-1].data)}")
        if "loss" in job.metrics:
            print(f"  loss: {format_loss(job.metrics['loss'])}")
        for what, key in (("train", "preference"), ("eval", "eval_preference")):
            rewards = format_rewards(job.metrics.get(key))
            if rewards:
                print(f"  {what} {rewards}")
        if job.plan:
            print(f"  plan: {format_bytes(job.plan.get('host_bytes'))} host RAM, "
                  f"{format_bytes(job.plan.get('gpu_bytes') or 0)} GPU memory")
        if job.queue_reason:
            pos = f"#{job.queue_position} " if job.queue_position else ""
            print(f"  waiting: {pos}{job.queue_reason}")
        if job.error:
            print(f"  error: [{job.error.code}] {job.error.message}")
        print(f"  output: {job.output_dir}")
        if checkpoints:
            print(f"  checkpoints: steps {', '.join(str(c.step) for c in checkpoints)}")
        lines = [line for line in (format_event(e) for e in events) if line]
        for line in lines[-args.events:]:
            print(f"  {line}")
    return 1 if job.status.value in ("failed", "cancelled") else 0


def _time(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"
