"""The one gate: every call that reaches the coordinator over Ray acts as the tenant of a verified credential.

Ray's own token (``ray_token``, under the service root) keeps out whoever does not hold it; this gate decides,
for those who do, which tenant a call acts as. The coordinator actor runs every call of a client through
`Gate.admit` (`horizon_ray.cluster.ray_actors.CoordinatorActor.call`): REST and /v1 (the API, which verified
the bearer key itself, presents the service credential and names the tenant), the CLI (`submit`, `status`,
cancelling on Ctrl-C) and `ray job submit -- horizon-ray finetune` (both present the tenant's own API key,
`HORIZON_API_KEY` or `--api-key`), and any other Ray client.

- The coordinator holds SHA-256 digests of the keys (``GateConfig.key_digests``), never the keys.
- A tenant's key acts as that tenant only: naming another tenant is refused, `nodes` hides other tenants'
  jobs, `queue(None)` is the tenant's own queue.
- The service credential is derived from the whole key table (`service_credential`): only a process that
  holds every tenant's key (the API) can present it, and it could act as any tenant anyway.
- Every path of a spec is confined (`Gate.confine`) the way the API confines it (`api/paths.py`), so that no
  path bypasses it: data under the tenant's uploads or a data root, models under a model root or named from the
  catalogue, output_dir under `<jobs_root>/<tenant>/`; never into another tenant's namespace; and a tracker
  URL only to an operator-approved host.

`serve --insecure-no-auth` gives a gate without keys: every call is tenant ``default``. A coordinator started
without any gate config (`start_service` in tests and the in-process twin) trusts the tenant it is told.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from horizon_ray.cluster.errors import InvalidSpec, Unauthorized
from horizon_ray.cluster.messages import NodeInfo

ENV_API_KEY = "HORIZON_API_KEY"  # a client's own key (the CLI, a Ray job's runtime env), as OPENAI_API_KEY
OPEN_TENANT = "default"  # the tenant of every call to a gate without keys (serve --insecure-no-auth)
# Methods that name no tenant. `ready` is a health probe; `nodes` and `queue` are filtered for a tenant.
_UNSCOPED = ("ready", "nodes", "queue", "whoami")
_SERVICE_CONTEXT = b"horizon-ray service credential v1"


def key_digest(key: str) -> str:
    """What the coordinator keeps of an API key: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def service_credential(api_keys: dict[str, str]) -> str | None:
    """The API's credential: an HMAC of the whole key table (None without keys). Every API process that holds
    the same keys derives the same one; knowing some of the keys does not give it."""
    if not api_keys:
        return None
    table = "\n".join(f"{k}={t}" for k, t in sorted(api_keys.items())).encode()
    return "svc-" + hmac.new(_SERVICE_CONTEXT, table, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class GateConfig:
    """What the coordinator's gate checks; plain data, handed to the actor as `to_wire()`."""

    key_digests: dict[str, str]  # key_digest(key) -> tenant; empty: no keys (every call is OPEN_TENANT)
    service_digest: str | None  # key_digest(service_credential(keys)); None without keys
    uploads_dir: str  # tenants' uploads: <uploads_dir>/<tenant>/
    jobs_root: str  # job outputs: <jobs_root>/<tenant>/
    data_roots: list[str] = field(default_factory=list)  # read-only dataset roots
    model_roots: list[str] = field(default_factory=list)  # read-only base-model roots
    model_catalogue: dict[str, str] = field(default_factory=dict)  # model name -> directory under a model root
    tracker_hosts: list[str] = field(default_factory=list)  # hosts a tracker URL of a spec may name

    @classmethod
    def from_keys(cls, api_keys: dict[str, str], **roots: Any) -> GateConfig:
        credential = service_credential(api_keys)
        return cls(key_digests={key_digest(k): t for k, t in api_keys.items()},
                   service_digest=key_digest(credential) if credential else None,
                   **{k: _plain(v) for k, v in roots.items()})

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> GateConfig:
        return cls(**d)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return str(value)


@dataclass(frozen=True)
class Principal:
    """Who a call acts as: one tenant, or the API (`tenant` None), which names the tenant it verified."""

    tenant: str | None


class Gate:
    """Admits a client's call: who it acts as, and the spec it may hand over."""

    def __init__(self, config: GateConfig):
        self.config = config
        self._jobs_root = Path(os.path.realpath(config.jobs_root))
        self._uploads = Path(os.path.realpath(config.uploads_dir))

    def principal(self, credential: str | None) -> Principal:
        """The verified principal of `credential`; Unauthorized naming the fix otherwise."""
        c = self.config
        if not c.key_digests:
            return Principal(OPEN_TENANT)
        if not credential:
            raise Unauthorized(f"this service needs an API key: set {ENV_API_KEY} (or pass --api-key) to a key the "
                               "operator gave you; a Ray job sets it with --runtime-env-json "
                               f"'{{\"env_vars\": {{\"{ENV_API_KEY}\": \"...\"}}}}'")
        digest = key_digest(credential)
        if c.service_digest and hmac.compare_digest(digest, c.service_digest):
            return Principal(None)
        found = None
        for known, tenant in c.key_digests.items():  # every digest compared, in constant time
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise Unauthorized(f"invalid API key; set {ENV_API_KEY} to a key the operator gave you")
        return Principal(found)

    def admit(self, method: str, args: tuple, kwargs: dict[str, Any], credential: str | None
              ) -> tuple[Principal, tuple, dict[str, Any]]:
        """The call's principal and its arguments once admitted: the tenant it names is the principal's, a
        spec's paths are confined. Raises Unauthorized or InvalidSpec."""
        if method == "ready":  # a health probe, of anyone who reaches Ray
            return Principal(None), args, kwargs
        who = self.principal(credential)
        if method in _UNSCOPED:
            if method == "queue" and who.tenant is not None:
                args, kwargs = (who.tenant,), {}  # a tenant sees its own queue, never everyone's
            return who, args, kwargs
        tenant = args[0] if args else kwargs.get("tenant")
        if who.tenant is not None and tenant != who.tenant:
            raise Unauthorized(f"this API key is tenant {who.tenant!r}'s; it cannot act as tenant {tenant!r}")
        if method in ("submit", "plan"):
            args = (args[0], self.confine(str(tenant), args[1]), *args[2:])
        return who, args, kwargs

    def shown(self, who: Principal, method: str, result: Any) -> Any:
        """What a principal sees of a result: a tenant sees no other tenant's job in a node's ledger."""
        if who.tenant is None or method != "nodes":
            return result
        return [_anonymised(n, who.tenant) for n in result]

    # ---- paths -------------------------------------------------------------------------------------

    def confine(self, tenant: str, spec: Any) -> dict[str, Any]:
        """A copy of `spec` whose paths are resolved and confined to what `tenant` may use."""
        if not isinstance(spec, dict):
            raise InvalidSpec("the job spec must be a mapping", field="body")
        out = dict(spec)
        for section, key, resolve in (("model", "path", self._model), ("model", "tokenizer_path", self._model),
                                      ("data", "path", self._dataset), ("data", "eval_path", self._dataset)):
            part = out.get(section)
            if not isinstance(part, dict) or part.get(key) in (None, ""):
                continue
            value = part[key]
            name = f"{section}.{key}"
            if not isinstance(value, str):
                raise InvalidSpec(f"{name} must be a string", field=name)
            out[section] = dict(part, **{key: resolve(name, tenant, value)})
        if out.get("output_dir") not in (None, ""):
            out["output_dir"] = self._output_dir(tenant, out["output_dir"])
        self._trackers(out)
        return out

    def _dataset(self, name: str, tenant: str, value: str) -> str:
        own = self._uploads / tenant
        roots = [own, *map(Path, self.config.data_roots)]
        found = self._under(name, value, roots, want_dir=False, what="data roots (HORIZON_DATA_ROOTS)")
        self._not_other_tenant(name, tenant, found)
        return str(found)

    def _model(self, name: str, tenant: str, value: str) -> str:
        if value in self.config.model_catalogue:
            value = self.config.model_catalogue[value]
        found = self._under(name, value, list(map(Path, self.config.model_roots)), want_dir=True,
                            what="model roots (HORIZON_MODEL_ROOTS, names: HORIZON_MODEL_CATALOGUE)")
        self._not_other_tenant(name, tenant, found)
        return str(found)

    def _output_dir(self, tenant: str, value: Any) -> str:
        if not isinstance(value, str):
            raise InvalidSpec("output_dir must be a string", field="output_dir")
        own = self._jobs_root / tenant
        path = Path(value) if os.path.isabs(value) else own / _relative("output_dir", value)
        if ".." in PurePosixPath(value).parts:
            raise InvalidSpec("output_dir: '..' is not allowed in paths", field="output_dir")
        resolved = Path(os.path.realpath(path))
        if resolved == own or not resolved.is_relative_to(own):  # a job of its own, inside the namespace
            raise InvalidSpec(f"output_dir {value!r} lies outside your output namespace {own}/; give a path relative "
                              "to it (e.g. output_dir=my-run) or none (the service makes one per job)",
                              field="output_dir")
        return str(resolved)

    def _trackers(self, spec: dict[str, Any]) -> None:
        integrations = spec.get("integrations")
        if not isinstance(integrations, dict):
            return
        mlflow = integrations.get("mlflow")
        uri = mlflow.get("tracking_uri") if isinstance(mlflow, dict) else None
        if isinstance(uri, str) and uri:
            host = (urlsplit(uri).hostname or "").lower()
            allowed = [h.lower() for h in self.config.tracker_hosts]
            if host not in allowed:
                hint = (f"the hosts it allows: {', '.join(allowed)}" if allowed else
                        "it allows none (HORIZON_TRACKER_HOSTS is not set)")
                raise InvalidSpec(f"integrations.mlflow.tracking_uri names host {host or uri!r}, which the operator "
                                  f"has not approved ({hint}); name an approved server or leave tracking_uri null "
                                  "for a store in the job's output directory",
                                  field="integrations.mlflow.tracking_uri")

    def _under(self, name: str, value: str, roots: list[Path], *, want_dir: bool, what: str) -> Path:
        kind = "directory" if want_dir else "file"
        if not roots:
            raise InvalidSpec(f"{name}: this service has no {what}; the operator sets them", field=name)
        if "\x00" in value or ".." in PurePosixPath(value).parts:
            raise InvalidSpec(f"{name}: '..' and NUL are not allowed in paths", field=name)
        if os.path.isabs(value):
            candidates = [Path(value)]
        else:
            rel = _relative(name, value)
            candidates = [root / rel for root in roots]
        for candidate in candidates:
            if not os.path.lexists(candidate):
                continue
            resolved = Path(os.path.realpath(candidate))
            if not self._within_any(resolved, roots):
                raise InvalidSpec(f"{name}: {value!r} lies outside the roots this service lets you read "
                                  f"({', '.join(map(str, roots))}); upload the data, or name a path under a root",
                                  field=name)
            if resolved.is_dir() if want_dir else resolved.is_file():
                return resolved
            raise InvalidSpec(f"{name}: {value!r} is not a {kind}", field=name)
        raise InvalidSpec(f"{name}: {value!r} was not found under the roots this service lets you read "
                          f"({', '.join(map(str, roots))})", field=name)

    @staticmethod
    def _within_any(path: Path, roots: list[Any]) -> bool:
        for root in roots:
            r = Path(os.path.realpath(root))
            if path == r or path.is_relative_to(r):
                return True
        return False

    def _not_other_tenant(self, name: str, tenant: str, path: Path) -> None:
        # a root that (mis)contains the tenants' namespaces must not open another tenant's files
        for base in (self._uploads, self._jobs_root):
            if (path == base or path.is_relative_to(base)) and not path.is_relative_to(base / tenant):
                raise InvalidSpec(f"{name} points into another tenant's namespace", field=name)


def _relative(name: str, value: str) -> PurePosixPath:
    rel = PurePosixPath(value.replace("\\", "/"))
    if value.startswith("~") or not rel.parts or rel == PurePosixPath(".") or ".." in rel.parts:
        raise InvalidSpec(f"{name}: {value!r} is not a plain relative path (no '~', no '..')", field=name)
    return rel


def _anonymised(node: NodeInfo, tenant: str) -> NodeInfo:
    ledger = [r if r.tenant == tenant else replace(r, job_id="(another tenant's)", tenant=None)
              for r in node.ledger]
    return replace(node, ledger=ledger)
