"""Tenant quotas, loaded strictly from a YAML file, and the fair order in which waiting jobs are served.

Tenants file::

    default:                      # quotas of any tenant not listed below
      max_concurrent_jobs: 2
      max_reserved_bytes: 64GiB   # int bytes or a size string (KiB, MiB, GiB, TiB; KB, MB, GB, TB)
      max_queued_jobs: 100
      max_steps_per_job: 20000    # optional: optimizer steps of one job (a job must then set max_steps)
      max_tokens_per_job: 2000000000  # optional: max_steps x seq_len x micro_batch_size x grad_accum x gpus
    tenants:
      acme: {max_concurrent_jobs: 4, max_reserved_bytes: 256GiB}
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from horizon_ray.cluster.messages import JobRecord, TenantQuota
from horizon_ray.errors import BadInput
from horizon_ray.planner import node as planner_node

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_bytes(value: Any, *, what: str = "size", unit_required: bool = False) -> int:
    """An int, or a string like "16GiB" / "1.5 TB", as bytes (the planner's units); BadInput naming `what`.
    `unit_required`: a string without a unit is refused (see the planner's parse_bytes)."""
    try:
        return planner_node.parse_bytes(value, unit_required=unit_required)
    except BadInput as exc:
        raise BadInput(f"{what}: {exc}") from None


def format_bytes(n: int | float | None) -> str:
    """Human form used in reasons: '12.0 GiB'."""
    if n is None:
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_tenant_name(tenant: str) -> None:
    """Tenant names become directory names: letters, digits, '_', '.', '-'; at most 64 characters."""
    if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
        raise BadInput(f"tenant name {tenant!r} is not allowed; use letters, digits, '_', '.', '-' "
                       "(at most 64, starting with a letter or digit)")


@dataclass
class TenantsConfig:
    """Quotas per tenant, with a default for tenants not listed."""

    default: TenantQuota = field(default_factory=TenantQuota)  # quotas of unlisted tenants
    tenants: dict[str, TenantQuota] = field(default_factory=dict)  # per-tenant overrides

    def quota(self, tenant: str) -> TenantQuota:
        return self.tenants.get(tenant, self.default)

    @classmethod
    def from_dict(cls, data: Any) -> TenantsConfig:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise BadInput("a tenants file is a mapping with keys 'default' and 'tenants'")
        unknown = set(data) - {"default", "tenants"}
        if unknown:
            raise BadInput(f"unknown key(s) {sorted(unknown)} in tenants file; valid: default, tenants")
        default = _quota(data.get("default") or {}, TenantQuota(), "default")
        tenants = {}
        for name, q in (data.get("tenants") or {}).items():
            check_tenant_name(name)
            tenants[name] = _quota(q or {}, default, f"tenants.{name}")
        return cls(default=default, tenants=tenants)

    @classmethod
    def load(cls, path: str | Path | None) -> TenantsConfig:
        if path is None:
            return cls()
        p = Path(path).expanduser()
        if not p.is_file():
            raise BadInput(f"tenants file {str(p)!r} does not exist; pass the path of a YAML tenants file")
        return cls.from_dict(yaml.safe_load(p.read_text()))


def _quota(data: Any, base: TenantQuota, where: str) -> TenantQuota:
    if not isinstance(data, dict):
        raise BadInput(f"{where} must be a mapping of quota keys")
    valid = {f.name for f in dataclasses.fields(TenantQuota)}
    unknown = set(data) - valid
    if unknown:
        raise BadInput(f"unknown key(s) {sorted(unknown)} in {where}; valid: {sorted(valid)}")
    values = dataclasses.asdict(base)
    for key, value in data.items():
        if key == "max_reserved_bytes":
            values[key] = parse_bytes(value, what=f"{where}.{key}")
        else:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadInput(f"{where}.{key} is {value!r}; set a positive integer")
            values[key] = value
    return TenantQuota(**values)


def fair_order(waiting: Iterable[JobRecord], last_served: dict[str, int]) -> list[JobRecord]:
    """Order in which waiting jobs are offered to the nodes.

    Recovering jobs come first (they were already running). Among queued jobs, tenants take turns, the
    least recently served first (a tenant never served counts as served longest ago), so a burst from one
    tenant cannot starve another; within a tenant, higher priority first, then first come first served.
    """
    jobs = list(waiting)
    recovering = sorted((j for j in jobs if j.status.value == "recovering"), key=_within_tenant_key)
    per_tenant: dict[str, list[JobRecord]] = {}
    for job in sorted((j for j in jobs if j.status.value != "recovering"), key=_within_tenant_key):
        per_tenant.setdefault(job.tenant, []).append(job)
    turn = {t: last_served.get(t, -1) for t in per_tenant}
    clock = max([*last_served.values(), 0]) + 1
    order: list[JobRecord] = []
    while per_tenant:
        tenant = min(per_tenant, key=lambda t: (turn[t], per_tenant[t][0].created_at, t))
        order.append(per_tenant[tenant].pop(0))
        if not per_tenant[tenant]:
            del per_tenant[tenant]
        turn[tenant] = clock
        clock += 1
    return recovering + order


def _within_tenant_key(job: JobRecord) -> tuple:
    return (-job.priority, job.created_at, job.id)
