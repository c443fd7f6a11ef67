"""Settings of the HTTP front end: API keys, the roots tenants may read, where their files live, limits.

Each setting is one field of ``ApiSettings`` (pydantic-settings): its name, type, default, description and
environment variable (``validation_alias``) are declared there once; the table ``horizon-ray serve --help`` and
the README print (``settings_text``, ``settings_markdown``; ``python -m api.settings --write-readme`` rewrites
the README's) is rendered from the fields. Built once, at the edge, by ``ApiSettings.from_env()`` (or by hand in
tests: the constructor reads no environment) and handed to ``create_app``; nothing below reads the environment
again. ``serve`` reads the same settings: the jobs root it gives the coordinator is the one the API serves
downloads from.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from horizon_ray.cluster.engine_env import ENV_ENGINE_ENV, SECRET_ENV_PREFIX
from horizon_ray.cluster.tenants import check_tenant_name
from horizon_ray.errors import BadInput
from horizon_ray.home import DEFAULT_HOME, HOME_VARIABLE, service_root

# Words of the keys that examples and templates ship (k8s/examples/api-keys.secret.yaml): a key holding one
# was copied, not generated, and anyone who read the same example could use it.
PLACEHOLDER_KEY_WORDS = ("replace-me", "replace_me", "replaceme", "change-me", "change_me", "changeme",
                         "placeholder", "your-key", "your_key", "your-api-key", "example")
MIN_KEY_CHARS = 16  # the shortest API key serve takes: a short one is guessed
README = Path(__file__).resolve().parent.parent / "README.md"
# The README's table lies between these lines; `python -m api.settings --write-readme` rewrites what is between.
TABLE_BEGIN = "<!-- settings table: rendered from api/settings.py by python -m api.settings --write-readme -->"
TABLE_END = "<!-- end of settings table -->"


@dataclass(frozen=True)
class Kind:
    """What a variable's value must be, in the words of its refusal."""

    what: str  # what an unparsable value is not, e.g. "an integer"
    fix: str  # what to give instead, e.g. "give a whole number of 1 or more"


COUNT = Kind("an integer", "give a whole number of 1 or more, or leave it unset for the default")
BYTES = Kind("a number of bytes", "give a positive integer, e.g. 1073741824 (1 GiB), or leave it unset for the "
                                  "default")
RATE = Kind("a number", "give one >= 0 (0: no limit), or leave it unset for the default")
FLAG = Kind("a yes or no", "give 1 or 0 (also true/false, yes/no, on/off), or leave it unset for the default")
Count = Annotated[int, Field(ge=1), COUNT]
Bytes = Annotated[int, Field(ge=1), BYTES]
Flag = Annotated[bool, FLAG]


class ApiSettings(BaseSettings):
    """Everything the app needs besides its coordinator client. Paths are resolved once, when it is built; a
    field with a ``validation_alias`` is the setting of that environment variable."""

    # the constructor takes keyword values only; from_env adds the variables of a given environment
    model_config = SettingsConfigDict(case_sensitive=True, env_ignore_empty=True, enable_decoding=False,
                                      populate_by_name=True, extra="forbid")

    api_keys: dict[str, str] = Field(
        default_factory=dict, validation_alias="HORIZON_API_KEYS",
        description="API keys and their tenants, key1=tenant-a,key2=tenant-b; serve refuses to start without a key "
                    "unless told --insecure-no-auth")
    api_keys_file: Path | None = Field(
        None, validation_alias="HORIZON_API_KEYS_FILE",
        description="a YAML or JSON file of {key: tenant} (or {keys: {...}}), read at start; adds to "
                    "HORIZON_API_KEYS")
    jobs_root: Path = Field(
        default_factory=lambda: service_root() / "jobs", validation_alias="HORIZON_JOBS_ROOT",
        json_schema_extra={"shown": "<service root>/jobs"},
        description="job outputs, <root>/<tenant>/<job>/ (checkpoints, metrics.jsonl, final/): the coordinator "
                    "writes there and the API serves them from there; on several nodes, storage every node sees")
    uploads_dir: Path = Field(
        default_factory=lambda: service_root() / "uploads", validation_alias="HORIZON_UPLOADS_DIR",
        json_schema_extra={"shown": "<service root>/uploads"},
        description="tenants' uploaded datasets, <dir>/<tenant>/; the nodes read them, so on several nodes shared "
                    "storage too")
    model_roots: list[Path] = Field(
        default_factory=list, validation_alias="HORIZON_MODEL_ROOTS",
        description=f"{os.pathsep}-separated read-only directories of base models that specs may name (model.path "
                    "relative to one of them)")
    model_catalogue: dict[str, Path] = Field(
        default_factory=dict, validation_alias="HORIZON_MODEL_CATALOGUE",
        description="name=/models/dir,...: model names tenants may use (model.path, and the model of the "
                    "OpenAI-compatible API); each directory under a model root")
    data_roots: list[Path] = Field(
        default_factory=list, validation_alias="HORIZON_DATA_ROOTS",
        description=f"{os.pathsep}-separated read-only dataset directories specs may name (data.path relative to "
                    "one of them); uploads need none")
    tracker_hosts: list[str] = Field(
        default_factory=list, validation_alias="HORIZON_TRACKER_HOSTS",
        description="comma-separated hosts a job's tracker URL (integrations.mlflow.tracking_uri) may name; any "
                    "other is refused, so that no job sends metrics (and the node's MLFLOW_TRACKING_TOKEN) "
                    "elsewhere")
    max_body_bytes: Bytes = Field(
        1 << 20, validation_alias="HORIZON_API_MAX_BODY_BYTES",
        description="largest JSON request body; larger ones get 413")
    max_upload_bytes: Bytes = Field(
        1 << 30, validation_alias="HORIZON_API_MAX_UPLOAD_BYTES",
        description="largest dataset upload (POST /files, POST /v1/files); larger ones get 413")
    max_upload_line_bytes: Bytes = Field(
        8 << 20, validation_alias="HORIZON_API_MAX_UPLOAD_LINE_BYTES",
        description="longest line (one example) an upload may have: what checking a line holds in memory at once; "
                    "a longer one is refused (422)")
    rate_limit_per_s: Annotated[float, Field(ge=0), RATE] = Field(
        20.0, validation_alias="HORIZON_API_RATE_LIMIT_PER_S",
        description="requests a second a tenant may make (a token bucket per tenant; 429 with Retry-After beyond); "
                    "0: no limit")
    rate_limit_burst: Count = Field(
        100, validation_alias="HORIZON_API_RATE_LIMIT_BURST",
        description="requests a tenant may make at once before the rate applies (the bucket's size)")
    max_streams_per_tenant: Count = Field(
        100, validation_alias="HORIZON_API_MAX_STREAMS_PER_TENANT",
        description="event streams (SSE) a tenant may hold open at once; 429 with Retry-After beyond")
    stream_poll_threads: Count = Field(
        4, validation_alias="HORIZON_API_STREAM_POLL_THREADS",
        description="threads the event streams' followers (one per streamed job) use to ask the coordinator")
    max_uploads_in_flight: Count = Field(
        2, validation_alias="HORIZON_API_MAX_UPLOADS_IN_FLIGHT",
        description="uploads (POST /files, POST /v1/files) a tenant may send at once; 429 with Retry-After beyond")
    max_files_per_tenant: Count = Field(
        1000, validation_alias="HORIZON_API_MAX_FILES_PER_TENANT",
        description="datasets a tenant may keep uploaded; 429 beyond (delete some)")
    max_file_bytes_per_tenant: Bytes = Field(
        100 << 30, validation_alias="HORIZON_API_MAX_FILE_BYTES_PER_TENANT",
        description="bytes of datasets a tenant may keep uploaded, all files together; 429 beyond (delete some)")
    metrics_open: Flag = Field(
        False, validation_alias="HORIZON_API_METRICS_OPEN",
        description="1: /metrics answers without a key (for a scraper inside the cluster); otherwise it needs one, "
                    "as it counts every tenant's jobs")
    docs: Flag = Field(
        False, validation_alias="HORIZON_API_DOCS",
        description="1: serve /docs (Swagger UI from the vendored files of the swagger-ui-bundle package, pip "
                    "install horizon-ray[docs]); otherwise /openapi.json only")
    # Set by the code that builds the app, never from the environment:
    sse_poll_s: float = Field(0.25, gt=0, description="how often an SSE stream polls the coordinator for new "
                                                      "events, seconds")
    sse_heartbeat_s: float = Field(15.0, gt=0, description="SSE comment line sent when nothing happened for this "
                                                           "long, seconds (keeps proxies from closing)")
    openai_api: bool = Field(True, description="mount the OpenAI-compatible API under /v1 (fine_tuning.jobs, files)")
    insecure_no_auth: bool = Field(False, description="no API keys: every request is tenant 'default' (serve "
                                                      "--insecure-no-auth; a machine of one's own only)")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _refusal(exc) from None

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The keyword values only: a settings object built by hand (tests, the demo) reads no environment;
        from_env reads the one it is given."""
        return (init_settings,)

    # ---- the variables' text forms (a value given by hand is already of its type) ----

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_text(cls, value: Any) -> Any:
        return parse_api_keys(value) if isinstance(value, str) else value

    @field_validator("model_catalogue", mode="before")
    @classmethod
    def _catalogue_text(cls, value: Any) -> Any:
        return _pairs(value, variable("model_catalogue")) if isinstance(value, str) else value

    @field_validator("model_roots", "data_roots", mode="before")
    @classmethod
    def _roots_text(cls, value: Any) -> Any:
        return [p for p in value.split(os.pathsep) if p] if isinstance(value, str) else value

    @field_validator("tracker_hosts", mode="before")
    @classmethod
    def _hosts_text(cls, value: Any) -> Any:
        return [h.strip().lower() for h in value.split(",") if h.strip()] if isinstance(value, str) else value

    @field_validator("metrics_open", "docs", mode="before")
    @classmethod
    def _flag_text(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value

    # ---- the rules across fields ----

    @model_validator(mode="after")
    def _check(self) -> ApiSettings:
        if self.api_keys_file is not None:  # the file's keys, then HORIZON_API_KEYS's over them
            self.api_keys = {**load_api_keys_file(self.api_keys_file), **self.api_keys}
        for key, tenant in self.api_keys.items():
            if not key or not key.strip():
                raise BadInput("an API key is empty; give every tenant a non-empty key")
            if any(word in key.lower() for word in PLACEHOLDER_KEY_WORDS):
                raise BadInput(
                    f"the API key of tenant {tenant!r} is a placeholder ({key[:12]}...), which anyone who read the "
                    f"example knows; put a random key in its place ({ENV_KEYS_FILE} or {ENV_KEYS}), e.g. from "
                    "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
            check_tenant_name(tenant)  # a tenant name becomes a directory name
        self.uploads_dir = self.uploads_dir.resolve()
        self.jobs_root = self.jobs_root.resolve()
        self.data_roots = [p.resolve() for p in self.data_roots]
        self.model_roots = [p.resolve() for p in self.model_roots]
        self.model_catalogue = {name: p.resolve() for name, p in self.model_catalogue.items()}
        for name, path in self.model_catalogue.items():
            if not any(path == root or path.is_relative_to(root) for root in self.model_roots):
                where = ", ".join(str(r) for r in self.model_roots) or f"none: {ENV_MODEL_ROOTS} is not set"
                raise BadInput(f"{ENV_MODEL_CATALOGUE}: {name}={path} lies under no model root ({where}); add its "
                               f"parent directory to {ENV_MODEL_ROOTS}")
        return self

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

    def replaced(self, **changes: Any) -> ApiSettings:
        """A copy with `changes`, checked as a new one is (its keys file's keys are in api_keys already)."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self)(**{**values, "api_keys_file": None, **changes})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, root: str | Path | None = None,
                 **overrides: Any) -> ApiSettings:
        """Settings from the variables of `environ` (default os.environ); keyword overrides win. `root`: the
        service root the default jobs root and uploads directory lie in (default `service_root()`)."""
        env = os.environ if environ is None else environ
        base = Path(root).expanduser() if root is not None else service_root(env)
        values: dict[str, Any] = {"jobs_root": base / "jobs", "uploads_dir": base / "uploads"}
        values.update({_FIELD_OF[var]: value for var, value in _Environ(cls, env)().items()})
        return cls(**{**values, **overrides})


class _Environ(EnvSettingsSource):
    """The variables of a given environment (not necessarily os.environ), for the fields that name one."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]):
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k: v for k, v in self._environ.items() if v != ""}  # an empty variable is an unset one

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if not isinstance(field.validation_alias, str):  # set by code only
            return None, field_name, False
        return super().get_field_value(field, field_name)


# variable -> field, for the fields an environment variable sets
_FIELD_OF: dict[str, str] = {f.validation_alias: name for name, f in ApiSettings.model_fields.items()
                             if isinstance(f.validation_alias, str)}


def variable(field_name: str) -> str:
    """The environment variable of a setting."""
    alias = ApiSettings.model_fields[field_name].validation_alias
    assert isinstance(alias, str), f"{field_name} is set by code, not by a variable"
    return alias


# The variables other modules name in their messages, each read from its field.
ENV_KEYS = variable("api_keys")
ENV_KEYS_FILE = variable("api_keys_file")
ENV_UPLOADS_DIR = variable("uploads_dir")
ENV_JOBS_ROOT = variable("jobs_root")
ENV_DATA_ROOTS = variable("data_roots")
ENV_MODEL_ROOTS = variable("model_roots")
ENV_MODEL_CATALOGUE = variable("model_catalogue")
ENV_HOME = HOME_VARIABLE  # the service root's (horizon_ray.home); ENV_ENGINE_ENV, imported: the node agents'
# Every variable that names a secret (the keys, their file) starts with SECRET_ENV_PREFIX, which no process but
# the API's may see: the node agents drop such variables from their engines' environment, serve from the Ray
# processes it starts.
assert all(v.startswith(SECRET_ENV_PREFIX) for v in (ENV_KEYS, ENV_KEYS_FILE))


def _refusal(exc: ValidationError) -> BadInput:
    """The first error of a validation as a BadInput naming the variable (or field) and the fix."""
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, BadInput):  # a rule of ours: its message already names the variable and the fix
        return cause
    name = str(err["loc"][0]) if err["loc"] else ""
    name = _FIELD_OF.get(name, name)
    field = ApiSettings.model_fields.get(name)
    if field is None:
        return BadInput(f"{name!r} is not a setting; the settings are: {', '.join(ApiSettings.model_fields)}")
    var = field.validation_alias if isinstance(field.validation_alias, str) else name
    kind = next((m for m in field.metadata if isinstance(m, Kind)), None)
    value = err.get("input")
    if kind is None:
        return BadInput(f"{var}={value!r} is refused: {err['msg']}")
    if err["type"] in ("greater_than_equal", "greater_than", "less_than", "less_than_equal"):
        return BadInput(f"{var}={value!r} is out of range; {kind.fix}")
    return BadInput(f"{var}={value!r} is not {kind.what}; {kind.fix}")


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


# ---- the table: rendered from the fields -------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One row of the table: an environment variable of the service."""

    env: str  # the variable
    default: str  # its default, as a person reads it
    help: str  # what it sets, one sentence


def _shown(field: FieldInfo) -> str:
    """A field's default as the table shows it."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "shown" in extra:
        return str(extra["shown"])
    value = field.get_default(call_default_factory=True)
    if value in (None, {}, []):
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if BYTES in field.metadata:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value} ({value // size} {unit})"
    return f"{value:g}" if isinstance(value, float) else str(value)


# The variables other parts of the service read (ENV_HOME, ENV_ENGINE_ENV), in the table for the operator's sake
OTHER_SETTINGS: tuple[Setting, ...] = (
    Setting(ENV_HOME, DEFAULT_HOME, "where horizon-ray keeps its files; serve's service root is <home>/service "
                                    "(job table, jobs/, uploads/) unless --root says otherwise"),
    Setting(ENV_ENGINE_ENV, "none", "comma-separated variables of a node's environment its engines may see "
                                    "besides the allow-list (e.g. MLFLOW_TRACKING_TOKEN,WANDB_API_KEY); set on the "
                                    "nodes"),
)
SETTINGS: tuple[Setting, ...] = (
    *(Setting(str(f.validation_alias), _shown(f), f.description or "") for f in ApiSettings.model_fields.values()
      if isinstance(f.validation_alias, str)),
    *OTHER_SETTINGS,
)


def settings_text() -> str:
    """The table for a terminal (`serve --help`)."""
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


def readme_with_table(text: str) -> str:
    """`text` (the README) with the rendered table between TABLE_BEGIN and TABLE_END."""
    head, begin, rest = text.partition(TABLE_BEGIN + "\n")
    _, end, tail = rest.partition(TABLE_END)
    if not (begin and end):
        raise BadInput(f"the README has no settings table between {TABLE_BEGIN!r} and {TABLE_END!r}; put those "
                       "two lines where the table goes")
    return f"{head}{begin}{settings_markdown()}\n{end}{tail}"


def main(argv: list[str]) -> int:
    """``python -m api.settings``: print the README's table; ``--write-readme``: rewrite the README's."""
    if argv == ["--write-readme"]:
        README.write_text(readme_with_table(README.read_text()))
        print(f"wrote the settings table of {README}")
    elif not argv:
        print(settings_markdown())
    else:
        print("usage: python -m api.settings [--write-readme]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
