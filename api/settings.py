"""Settings of the HTTP front end: API keys, the roots tenants may read, where their files live, limits.

Every setting is an environment variable of ``SETTINGS``, the one table ``horizon-ray serve --help`` and the
README print. Built once, at the edge, by ``ApiSettings.from_env()`` (or by hand in tests) and handed to
``create_app``; nothing below reads the environment again. ``serve`` reads the same table: the jobs root it
gives the coordinator is the one the API serves downloads from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from horizon_ray.cluster.engine_env import ENV_ENGINE_ENV, SECRET_ENV_PREFIX
from horizon_ray.cluster.tenants import check_tenant_name
from horizon_ray.errors import BadInput
from horizon_ray.home import HOME_VARIABLE, service_root

ENV_KEYS = "HORIZON_API_KEYS"  # "key1=tenant-a,key2=tenant-b"
ENV_KEYS_FILE = "HORIZON_API_KEYS_FILE"  # YAML/JSON mapping key -> tenant, or {"keys": {...}}
ENV_UPLOADS_DIR = "HORIZON_UPLOADS_DIR"  # tenants' uploaded datasets: <dir>/<tenant>/
ENV_JOBS_ROOT = "HORIZON_JOBS_ROOT"  # the coordinator's jobs_root: outputs live in <root>/<tenant>/
ENV_DATA_ROOTS = "HORIZON_DATA_ROOTS"  # os.pathsep-separated read-only dataset roots
ENV_MODEL_ROOTS = "HORIZON_MODEL_ROOTS"  # os.pathsep-separated read-only base-model roots
ENV_MODEL_CATALOGUE = "HORIZON_MODEL_CATALOGUE"  # "name=/models/dir,name2=/models/dir2"
ENV_TRACKER_HOSTS = "HORIZON_TRACKER_HOSTS"  # "mlflow.internal,mlflow2.internal": hosts a spec's tracker URL may name
ENV_MAX_BODY = "HORIZON_API_MAX_BODY_BYTES"
# Words of the keys that examples and templates ship (k8s/examples/api-keys.secret.yaml): a key holding one
# was copied, not generated, and anyone who read the same example could use it.
PLACEHOLDER_KEY_WORDS = ("replace-me", "replace_me", "replaceme", "change-me", "change_me", "changeme",
                         "placeholder", "your-key", "your_key", "your-api-key", "example")
ENV_MAX_UPLOAD = "HORIZON_API_MAX_UPLOAD_BYTES"
ENV_HOME = HOME_VARIABLE
# Per-tenant limits (api/quotas.py) and what bounds the work of one request
ENV_RATE_LIMIT = "HORIZON_API_RATE_LIMIT_PER_S"
ENV_RATE_BURST = "HORIZON_API_RATE_LIMIT_BURST"
ENV_MAX_STREAMS = "HORIZON_API_MAX_STREAMS_PER_TENANT"
ENV_STREAM_THREADS = "HORIZON_API_STREAM_POLL_THREADS"
ENV_MAX_UPLOADS = "HORIZON_API_MAX_UPLOADS_IN_FLIGHT"
ENV_MAX_FILES = "HORIZON_API_MAX_FILES_PER_TENANT"
ENV_MAX_FILE_BYTES = "HORIZON_API_MAX_FILE_BYTES_PER_TENANT"
ENV_MAX_LINE = "HORIZON_API_MAX_UPLOAD_LINE_BYTES"
_NUMBERS = {  # setting -> (its variable, its type)
    "rate_limit_per_s": (ENV_RATE_LIMIT, float),
    "rate_limit_burst": (ENV_RATE_BURST, int),
    "max_streams_per_tenant": (ENV_MAX_STREAMS, int),
    "stream_poll_threads": (ENV_STREAM_THREADS, int),
    "max_uploads_in_flight": (ENV_MAX_UPLOADS, int),
    "max_files_per_tenant": (ENV_MAX_FILES, int),
    "max_file_bytes_per_tenant": (ENV_MAX_FILE_BYTES, int),
    "max_upload_line_bytes": (ENV_MAX_LINE, int),
}
ENV_DOCS = "HORIZON_API_DOCS"  # 1: serve /docs (Swagger UI from the files of the swagger-ui-bundle package)
ENV_METRICS_OPEN = "HORIZON_API_METRICS_OPEN"  # 1: /metrics without a key
MIN_KEY_CHARS = 16  # the shortest API key serve takes: a short one is guessed
# Every variable above that names a secret (the keys, their file) starts with SECRET_ENV_PREFIX, which no process
# but the API's may see: the node agents drop such variables from their engines' environment, serve from the Ray
# processes it starts.
assert all(v.startswith(SECRET_ENV_PREFIX) for v in (ENV_KEYS, ENV_KEYS_FILE))


@dataclass(frozen=True)
class Setting:
    """One environment variable of the service."""

    env: str  # the variable
    default: str  # its default, as a person reads it
    help: str  # what it sets, one sentence


SETTINGS: tuple[Setting, ...] = (
    Setting(ENV_KEYS, "none", "API keys and their tenants, key1=tenant-a,key2=tenant-b; serve refuses to start "
                              "without a key unless told --insecure-no-auth"),
    Setting(ENV_KEYS_FILE, "none", "a YAML or JSON file of {key: tenant} (or {keys: {...}}), read at start; "
                                   "adds to HORIZON_API_KEYS"),
    Setting(ENV_HOME, "~/.cache/horizon-ray", "where horizon-ray keeps its files; serve's service root is "
                                              "<home>/service (job table, jobs/, uploads/) unless --root says "
                                              "otherwise"),
    Setting(ENV_JOBS_ROOT, "<service root>/jobs", "job outputs, <root>/<tenant>/<job>/ (checkpoints, metrics.jsonl, "
                                                  "final/): the coordinator writes there and the API serves them "
                                                  "from there; on several nodes, storage every node sees"),
    Setting(ENV_UPLOADS_DIR, "<service root>/uploads", "tenants' uploaded datasets, <dir>/<tenant>/; the nodes "
                                                       "read them, so on several nodes shared storage too"),
    Setting(ENV_MODEL_ROOTS, "none", f"{os.pathsep}-separated read-only directories of base models that specs may "
                                     "name (model.path relative to one of them)"),
    Setting(ENV_MODEL_CATALOGUE, "none", "name=/models/dir,...: model names tenants may use (model.path, and the "
                                         "model of the OpenAI-compatible API); each directory under a model root"),
    Setting(ENV_DATA_ROOTS, "none", f"{os.pathsep}-separated read-only dataset directories specs may name "
                                    "(data.path relative to one of them); uploads need none"),
    Setting(ENV_TRACKER_HOSTS, "none", "comma-separated hosts a job's tracker URL (integrations.mlflow.tracking_uri) "
                                       "may name; any other is refused, so that no job sends metrics (and the node's "
                                       "MLFLOW_TRACKING_TOKEN) elsewhere"),
    Setting(ENV_ENGINE_ENV, "none", "comma-separated variables of a node's environment its engines may see besides "
                                    "the allow-list (e.g. MLFLOW_TRACKING_TOKEN,WANDB_API_KEY); set on the nodes"),
    Setting(ENV_MAX_BODY, "1048576 (1 MiB)", "largest JSON request body; larger ones get 413"),
    Setting(ENV_MAX_UPLOAD, "1073741824 (1 GiB)", "largest dataset upload (POST /files, POST /v1/files); larger "
                                                  "ones get 413"),
    Setting(ENV_MAX_LINE, "8388608 (8 MiB)", "longest line (one example) an upload may have: what checking a line "
                                             "holds in memory at once; a longer one is refused (422)"),
    Setting(ENV_RATE_LIMIT, "20", "requests a second a tenant may make (a token bucket per tenant; 429 with "
                                  "Retry-After beyond); 0: no limit"),
    Setting(ENV_RATE_BURST, "100", "requests a tenant may make at once before the rate applies (the bucket's size)"),
    Setting(ENV_MAX_STREAMS, "100", "event streams (SSE) a tenant may hold open at once; 429 with Retry-After "
                                    "beyond"),
    Setting(ENV_STREAM_THREADS, "4", "threads the event streams' followers (one per streamed job) use to ask the "
                                     "coordinator"),
    Setting(ENV_MAX_UPLOADS, "2", "uploads (POST /files, POST /v1/files) a tenant may send at once; 429 with "
                                  "Retry-After beyond"),
    Setting(ENV_MAX_FILES, "1000", "datasets a tenant may keep uploaded; 429 beyond (delete some)"),
    Setting(ENV_MAX_FILE_BYTES, "107374182400 (100 GiB)", "bytes of datasets a tenant may keep uploaded, all files "
                                                          "together; 429 beyond (delete some)"),
    Setting(ENV_METRICS_OPEN, "0", "1: /metrics answers without a key (for a scraper inside the cluster); otherwise "
                                   "it needs one, as it counts every tenant's jobs"),
    Setting(ENV_DOCS, "0", "1: serve /docs (Swagger UI from the vendored files of the swagger-ui-bundle package, pip "
                           "install horizon-ray[docs]); otherwise /openapi.json only"),
)


def settings_text() -> str:
    """The table for a terminal (`serve --help`)."""
    import textwrap

    lines = ["settings (environment variables):"]
    for s in SETTINGS:
        lines.append(f"  {s.env} (default {s.default})")
        lines += textwrap.wrap(s.help, width=100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def settings_markdown() -> str:
    """The table for the README."""
    rows = ["| variable | default | what it sets |", "|---|---|---|"]
    rows += [f"| `{s.env}` | {s.default} | {s.help} |" for s in SETTINGS]
    return "\n".join(rows)


@dataclass
class ApiSettings:
    """Everything the app needs besides its coordinator client. Paths are resolved once in __post_init__."""

    # bearer API key -> tenant name
    api_keys: dict[str, str] = field(default_factory=dict)
    # uploaded datasets: <uploads_dir>/<tenant>/file-<id>.jsonl (on storage every node sees)
    uploads_dir: Path = field(default_factory=lambda: service_root() / "uploads")
    # the coordinator's jobs_root: a job's outputs go to <jobs_root>/<tenant>/<job id or given name>/
    jobs_root: Path = field(default_factory=lambda: service_root() / "jobs")
    # read-only dataset roots every tenant may name (e.g. shared public datasets)
    data_roots: list[Path] = field(default_factory=list)
    # read-only base-model roots; a spec names a model by a path relative to one of them
    model_roots: list[Path] = field(default_factory=list)
    # catalogue name -> model directory (must itself lie under a model root)
    model_catalogue: dict[str, Path] = field(default_factory=dict)
    # largest JSON request body; larger ones get 413
    max_body_bytes: int = 1 << 20
    # largest dataset upload through POST /files; larger ones get 413
    max_upload_bytes: int = 1 << 30
    # how often an SSE stream polls the coordinator for new events, seconds
    sse_poll_s: float = 0.25
    # SSE comment line sent when nothing happened for this long, seconds (keeps proxies from closing)
    sse_heartbeat_s: float = 15.0
    # mount the OpenAI-compatible API under /v1 (fine_tuning.jobs, files)
    openai_api: bool = True
    # no API keys: every request is tenant "default" (serve --insecure-no-auth; a machine of one's own only)
    insecure_no_auth: bool = False
    # requests a second a tenant may make (a token bucket per tenant; 429 with Retry-After beyond); 0: no limit
    rate_limit_per_s: float = 20.0
    # requests a tenant may make at once before the rate applies (the bucket's size)
    rate_limit_burst: int = 100
    # event streams (SSE) a tenant may hold open at once; 429 with Retry-After beyond
    max_streams_per_tenant: int = 100
    # threads the event streams' followers (one per streamed job) use to ask the coordinator
    stream_poll_threads: int = 4
    # uploads (POST /files) a tenant may send at once; 429 with Retry-After beyond
    max_uploads_in_flight: int = 2
    # datasets a tenant may keep uploaded; 429 beyond (delete some)
    max_files_per_tenant: int = 1000
    # bytes of datasets a tenant may keep uploaded, all files together; 429 beyond (delete some)
    max_file_bytes_per_tenant: int = 100 << 30
    # longest line (one example) an upload may have: what checking a line holds in memory at once
    max_upload_line_bytes: int = 8 << 20
    # hosts a job's tracker URL may name (integrations.mlflow.tracking_uri); none: no tracker URL is accepted
    tracker_hosts: list[str] = field(default_factory=list)
    # /metrics without a key (it counts every tenant's jobs; a scraper otherwise sends a key)
    metrics_open: bool = False
    # serve /docs: Swagger UI from the vendored files of the swagger-ui-bundle package (pip install
    # horizon-ray[docs]), under a Content-Security-Policy; off: /openapi.json only
    docs: bool = False

    def __post_init__(self) -> None:
        for key, tenant in self.api_keys.items():
            if not key or not key.strip():
                raise BadInput("an API key is empty; give every tenant a non-empty key")
            if any(word in key.lower() for word in PLACEHOLDER_KEY_WORDS):
                raise BadInput(
                    f"the API key of tenant {tenant!r} is a placeholder ({key[:12]}...), which anyone who read the "
                    f"example knows; put a random key in its place ({ENV_KEYS_FILE} or {ENV_KEYS}), e.g. from "
                    "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
            check_tenant_name(tenant)  # a tenant name becomes a directory name
        self.uploads_dir = Path(self.uploads_dir).resolve()
        self.jobs_root = Path(self.jobs_root).resolve()
        self.data_roots = [Path(p).resolve() for p in self.data_roots]
        self.model_roots = [Path(p).resolve() for p in self.model_roots]
        self.model_catalogue = {name: Path(p).resolve() for name, p in self.model_catalogue.items()}
        if self.max_body_bytes <= 0 or self.max_upload_bytes <= 0:
            raise BadInput(f"{ENV_MAX_BODY} and {ENV_MAX_UPLOAD} must be positive")
        for name, path in self.model_catalogue.items():
            if not any(path == root or path.is_relative_to(root) for root in self.model_roots):
                where = ", ".join(str(r) for r in self.model_roots) or f"none: {ENV_MODEL_ROOTS} is not set"
                raise BadInput(f"{ENV_MODEL_CATALOGUE}: {name}={path} lies under no model root ({where}); add its "
                               f"parent directory to {ENV_MODEL_ROOTS}")
        if self.rate_limit_per_s < 0 or self.rate_limit_burst < 1:
            raise BadInput(f"rate_limit_per_s is {self.rate_limit_per_s} and rate_limit_burst {self.rate_limit_burst}; "
                           "give a rate >= 0 (0: no limit) and a burst >= 1")
        for name in ("max_streams_per_tenant", "stream_poll_threads", "max_uploads_in_flight", "max_files_per_tenant",
                     "max_file_bytes_per_tenant", "max_upload_line_bytes"):
            if getattr(self, name) < 1:
                raise BadInput(f"{name} is {getattr(self, name)}; give a positive number ({_NUMBERS[name][0]})")

    def check_served_keys(self) -> None:
        """What a served API (serve, app_from_env) also needs of its keys: none shorter than MIN_KEY_CHARS."""
        for key, tenant in self.api_keys.items():
            if len(key.strip()) < MIN_KEY_CHARS:
                raise BadInput(f"the API key of tenant {tenant!r} has {len(key.strip())} characters; give it at least "
                               f"{MIN_KEY_CHARS} random ones, e.g. python -c 'import secrets; "
                               "print(secrets.token_urlsafe(24))'")

    def files_dir(self, tenant: str) -> Path:
        """Where a tenant's uploaded datasets live."""
        return self.uploads_dir / tenant

    def outputs_dir(self, tenant: str) -> Path:
        """Where a tenant's job outputs (checkpoints, final model, adapter) live."""
        return self.jobs_root / tenant

    @property
    def namespace_roots(self) -> tuple[Path, Path]:
        """The directories holding every tenant's namespace."""
        return (self.uploads_dir, self.jobs_root)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, root: str | Path | None = None,
                 **overrides) -> ApiSettings:
        """Settings from the variables of SETTINGS; keyword overrides win. `root`: the service root the
        default jobs root and uploads directory lie in (default `service_root()`)."""
        env = os.environ if environ is None else environ
        base = Path(root).expanduser() if root is not None else service_root(env)
        keys: dict[str, str] = {}
        if env.get(ENV_KEYS_FILE):
            keys.update(load_api_keys_file(env[ENV_KEYS_FILE]))
        if env.get(ENV_KEYS):
            keys.update(parse_api_keys(env[ENV_KEYS]))
        kwargs: dict = {"api_keys": keys, "uploads_dir": Path(env.get(ENV_UPLOADS_DIR) or base / "uploads"),
                        "jobs_root": Path(env.get(ENV_JOBS_ROOT) or base / "jobs")}
        if env.get(ENV_DATA_ROOTS):
            kwargs["data_roots"] = [Path(p) for p in env[ENV_DATA_ROOTS].split(os.pathsep) if p]
        if env.get(ENV_MODEL_ROOTS):
            kwargs["model_roots"] = [Path(p) for p in env[ENV_MODEL_ROOTS].split(os.pathsep) if p]
        if env.get(ENV_MODEL_CATALOGUE):
            kwargs["model_catalogue"] = {name: Path(p) for name, p in
                                         _pairs(env[ENV_MODEL_CATALOGUE], ENV_MODEL_CATALOGUE).items()}
        for var, key in ((ENV_MAX_BODY, "max_body_bytes"), (ENV_MAX_UPLOAD, "max_upload_bytes")):
            if env.get(var):
                try:
                    kwargs[key] = int(env[var])
                except ValueError:
                    raise BadInput(f"{var}={env[var]!r} is not a number of bytes; give an integer, e.g. "
                                   "1073741824") from None
        for name, (var, kind) in _NUMBERS.items():
            if env.get(var):
                try:
                    kwargs[name] = kind(env[var])
                except ValueError:
                    raise BadInput(f"{var}={env[var]!r} is not {'an integer' if kind is int else 'a number'}; "
                                   f"set it to one, or leave it unset for the default") from None
        if env.get(ENV_TRACKER_HOSTS):
            kwargs["tracker_hosts"] = [h.strip().lower() for h in env[ENV_TRACKER_HOSTS].split(",") if h.strip()]
        if env.get(ENV_METRICS_OPEN):
            kwargs["metrics_open"] = env[ENV_METRICS_OPEN].strip().lower() in ("1", "true", "yes", "on")
        if env.get(ENV_DOCS):
            kwargs["docs"] = env[ENV_DOCS].strip().lower() in ("1", "true", "yes", "on")
        kwargs.update(overrides)
        return cls(**kwargs)


def parse_api_keys(text: str) -> dict[str, str]:
    """``"key1=tenant-a,key2=tenant-b"`` -> ``{"key1": "tenant-a", "key2": "tenant-b"}``."""
    return _pairs(text, ENV_KEYS)


def _pairs(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise BadInput(f"{what}: entry {item!r} is not NAME=VALUE; write a=x,b=y (e.g. key1=tenant-a)")
        out[key.strip()] = value.strip()
    return out


def load_api_keys_file(path: str | Path) -> dict[str, str]:
    """A YAML or JSON file holding ``{key: tenant}`` or ``{"keys": {key: tenant}}``."""
    try:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise BadInput(f"{ENV_KEYS_FILE}={path}: cannot read it ({type(exc).__name__}: {exc}); point it at a YAML "
                       "or JSON file of {key: tenant}") from None
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise BadInput(f"{ENV_KEYS_FILE}={path}: expected a mapping of API key -> tenant name")
    return dict(data)
