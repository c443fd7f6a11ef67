"""``horizon-ray submit JOB.yaml [key=value ...]``: hand a job spec to the coordinator of a running service.

Prints the job id and where it went (its node, or why it waits and its place in the queue). With
--follow, prints its progress until it ends and exits 0 only when it succeeded. Exit codes: 0 accepted
(or succeeded with --follow), 1 failed or cancelled (--follow), 2 refused (invalid spec, rejected because
no node can ever hold it, over quota) or no service reachable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, metavar="JOB.yaml", help="the job spec (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override spec values, e.g. training.lr=1e-4")
    add_connection_arguments(parser)
    parser.add_argument("--name", default=None, help="a label for the job (default: the spec's name)")
    parser.add_argument("--priority", type=int, default=0, help="higher runs first among your jobs")
    parser.add_argument("--idempotency-key", default=None,
                        help="a retried submit with the same key returns the same job")
    parser.add_argument("--follow", "-f", action="store_true", help="print progress until the job ends")
    parser.add_argument("--json", action="store_true", help="print the job record as JSON")


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", default=None,
                        help="tenant to act as (default $HORIZON_RAY_TENANT or 'default')")
    parser.add_argument("--address", default=None,
                        help="Ray cluster of the service (default $HORIZON_RAY_ADDRESS, $RAY_ADDRESS, the "
                             "address `serve` wrote under --root, else auto)")
    parser.add_argument("--root", type=Path, default=None, help="the service root given to `serve`")


def connect(args: argparse.Namespace):
    """(client, tenant) for the service the arguments name."""
    import os

    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.local import resolve_address

    tenant = args.tenant or os.environ.get("HORIZON_RAY_TENANT") or "default"
    return RayClient(resolve_address(args.address, args.root)), tenant


def run(args: argparse.Namespace) -> int:
    from horizon_ray.cluster.errors import HorizonError
    from horizon_ray.cluster.follow import follow
    from horizon_ray.jobspec import JobSpec, read_yaml

    path = args.config.expanduser()
    spec = read_yaml(path, args.overrides)
    JobSpec.parse(spec)  # strictly: names a section that is not a mapping, a misspelt key
    for section, key in (("model", "path"), ("data", "path"), ("data", "eval_path"),
                         ("model", "tokenizer_path")):
        value = (spec.get(section) or {}).get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            # relative paths are relative to the spec file, not to the node's working directory
            spec[section][key] = str((path.parent / value).resolve())
    if isinstance(spec.get("output_dir"), str) and not Path(spec["output_dir"]).expanduser().is_absolute():
        spec["output_dir"] = str((path.parent / spec["output_dir"]).resolve())
    try:
        client, tenant = connect(args)
        job = client.submit(tenant, spec, idempotency_key=args.idempotency_key, priority=args.priority,
                            name=args.name)
    except HorizonError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(job.to_dict(), indent=2))
    else:
        if job.status.value == "running":
            where = f"on node {job.node_id}"
        elif job.queue_position:
            where = f"position {job.queue_position}: {job.queue_reason}"
        else:
            where = job.queue_reason or ""
        print(f"{job.id} {job.status.value} {where}".rstrip())
        print(f"output: {job.output_dir}")
    if args.follow:
        return follow(client, tenant, job.id)
    return 0
