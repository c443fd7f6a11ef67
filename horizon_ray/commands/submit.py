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

from horizon_ray.cluster.gate import ENV_API_KEY


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
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"your API key: you act as its tenant, the one whose jobs the dashboard shows for it "
                             f"(default ${ENV_API_KEY}; a flag shows in the process list, the variable does not)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster of the service (default $HORIZON_RAY_ADDRESS, $RAY_ADDRESS, the "
                             "address `serve` wrote under --root, else auto)")
    parser.add_argument("--root", type=Path, default=None, help="the service root given to `serve`")


def connect(args: argparse.Namespace):
    """(client, tenant) for the service the arguments name: the tenant is the one of the API key
    (--api-key or $HORIZON_API_KEY) the coordinator verified; printed to stderr."""
    import os

    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.local import default_root, resolve_address, use_ray_token

    root = (args.root or default_root()).expanduser()
    use_ray_token(root, create=False)  # the Ray token of the service serve runs for this root, when there is one
    key = args.api_key or os.environ.get(ENV_API_KEY) or None
    client = RayClient(resolve_address(args.address, args.root), credential=key)
    tenant = client.whoami()
    print(f"acting as tenant {tenant}", file=sys.stderr)
    return client, tenant


def local_spec(path: Path, overrides: list[str] | tuple[str, ...] = (), cwd: Path | None = None) -> dict:
    """The spec file as plain data to hand to the service, whose nodes resolve no relative path: parsed
    strictly (a misspelt key is refused here), ~ and $HORIZON_RAY_HOME expanded on this machine, and each
    relative input path made absolute where it was written: a path in the file relative to the file, a path
    given as a key=value override relative to `cwd` (default: the working directory). A relative output_dir
    stays relative: the service puts it in the tenant's output namespace."""
    from horizon_ray.jobspec import JobSpec, apply_overrides, read_yaml

    spec = read_yaml(path)
    _absolute(spec, path.expanduser().resolve().parent)
    given = apply_overrides({}, overrides)
    _absolute(given, (cwd or Path.cwd()).resolve())
    spec = _merge(spec, given)
    JobSpec.parse(spec)
    return spec


_PATHS = (("model", "path"), ("model", "tokenizer_path"), ("data", "path"), ("data", "eval_path"))


def _absolute(spec: dict, base: Path) -> None:
    from horizon_ray.jobspec import expand_path

    def fix(value):
        if not isinstance(value, str) or not value:
            return value
        value = expand_path(value)
        return value if Path(value).is_absolute() else str((base / value).resolve())

    for section, key in _PATHS:
        if isinstance(spec.get(section), dict) and key in spec[section]:
            spec[section][key] = fix(spec[section][key])
    # output_dir is not made absolute: a relative one lies in the tenant's output namespace on the service


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


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
