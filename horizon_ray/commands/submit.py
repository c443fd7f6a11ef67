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


def local_spec(path: Path, overrides: list[str]) -> dict:
    """The spec file as plain data to send: parsed strictly (a misspelt key is refused here), ~ and
    $HORIZON_RAY_HOME expanded on this machine, relative paths made relative to the spec file (not to the
    node's working directory)."""
    from horizon_ray.jobspec import JobSpec, expand_path, read_yaml

    spec = read_yaml(path, overrides)
    JobSpec.parse(spec)
    for section, key in (("model", "path"), ("data", "path"), ("data", "eval_path"),
                         ("model", "tokenizer_path")):
        value = (spec.get(section) or {}).get(key)
        if isinstance(value, str) and value:
            value = expand_path(value)
            spec[section][key] = value if Path(value).is_absolute() else str((path.parent / value).resolve())
    if isinstance(spec.get("output_dir"), str) and spec["output_dir"]:
        value = expand_path(spec["output_dir"])
        spec["output_dir"] = value if Path(value).is_absolute() else str((path.parent / value).resolve())
    return spec


def run(args: argparse.Namespace) -> int:
    from horizon_ray.cluster.errors import HorizonError
    from horizon_ray.cluster.follow import follow, format_refusal
    from horizon_ray.data.stats import check_spec_data
    from horizon_ray.jobspec import JobSpec

    path = args.config.expanduser()
    spec = local_spec(path, args.overrides)
    # every line of the data this machine sees, checked now rather than on the node once placed
    check_spec_data(JobSpec.parse(spec))
    try:
        client, tenant = connect(args)
        job = client.submit(tenant, spec, idempotency_key=args.idempotency_key, priority=args.priority,
                            name=args.name)
    except HorizonError as exc:
        print(format_refusal(exc), file=sys.stderr)
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
