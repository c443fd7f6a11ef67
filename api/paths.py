"""Path confinement: what a tenant's job spec may read and where its outputs go.

A tenant names
- datasets as an uploaded file id (``file-...``, its own only), as a path relative to a configured
  read-only data root, or as an absolute path inside one;
- base models (and tokenizers) as a catalogue name, a path relative to a model root, or an absolute path
  inside one;
- its output directory as nothing (the coordinator makes one per job) or a path relative to its own
  output namespace.
Anything else is refused with a 422 that names the field: absolute paths elsewhere, ``..`` components,
``~``, symlinks that resolve outside their root, and any path into another tenant's namespace.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from api.errors import ApiError
from api.settings import ENV_DATA_ROOTS, ENV_MODEL_CATALOGUE, ENV_MODEL_ROOTS, ApiSettings
from horizon_ray.data.preference import FORMAT as PREFERENCE
from horizon_ray.strings import MAX_PATH_BYTES, OUTPUT_ROOM_BYTES, problem

FILE_ID_RE = re.compile(r"^file-[0-9a-f]{24}$")


def upload_meta_path(files_dir: Path, file_id: str) -> Path:
    """Where POST /files records an upload's metadata (its checked format, example count, ...)."""
    return files_dir / f"{file_id}.json"


def read_upload_meta(files_dir: Path, file_id: str) -> dict[str, Any] | None:
    """An upload's metadata, or None (no such upload, or its name is a link: never followed)."""
    opened = open_regular(upload_meta_path(files_dir, file_id))
    if opened is None:
        return None
    fd, _ = opened
    try:
        with os.fdopen(fd, "rb") as f:
            meta = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def open_regular(path: Path) -> tuple[int, int] | None:
    """(an open file descriptor, its size) when `path` is a regular file and no symbolic link; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # missing, a link (ELOOP), a name too long ...
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device is no upload
        os.close(fd)
        return None
    return fd, st.st_size


def regular_file(path: Path) -> bool:
    """`path` is a regular file itself, not a symbolic link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def single_file(path: Path) -> bool:
    """`path` is a regular file, not a symbolic link, with no other name (a hard link): what is served as a
    job's output. A second name may be one planted beside a file outside the directory (the tenant's engine and
    the service share a user), and serving it would hand out that file."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def plain_dir_at(path: Path, parent: Path) -> Path | None:
    """`path` when it is a plain directory (no link) whose real location is `parent`'s real location plus its
    name: a tenant's namespace as the settings put it, never one planted as a link to another's."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    return path if Path(os.path.realpath(path)) == Path(os.path.realpath(parent)) / path.name else None


def own_files_dir(settings: ApiSettings, tenant: str) -> Path | None:
    """The tenant's upload directory when it exists as a plain directory where the settings put it (not a
    link, and not under a link); None otherwise: nothing is read through a link."""
    return plain_dir_at(settings.files_dir(tenant), settings.uploads_dir)


def upload_dir(settings: ApiSettings, tenant: str) -> Path:
    """The tenant's upload directory, made when missing; RuntimeError when something planted a link in its
    place (uploads never go through one)."""
    settings.uploads_dir.mkdir(parents=True, exist_ok=True)
    path = settings.files_dir(tenant)
    try:
        os.mkdir(path, 0o750)
    except FileExistsError:
        pass
    found = own_files_dir(settings, tenant)
    if found is None:
        raise RuntimeError(f"the upload directory {path} is not a plain directory (a symbolic link?); "
                           "uploads are refused until the operator replaces it")
    return found


def refuse(field: str, message: str) -> ApiError:
    return ApiError(422, "path_not_allowed", f"{field}: {message}", field=field)


def is_within(path: Path, root: Path) -> bool:
    """True when the (already resolved) `path` is `root` or lies under it."""
    return path == root or path.is_relative_to(root)


def safe_relative(field: str, value: str) -> PurePosixPath:
    """A relative path with no `..`, no `~`, no empty or NUL parts; raises the 422 otherwise."""
    if "\x00" in value:
        raise refuse(field, "contains a NUL byte")
    if value.startswith("~"):
        raise refuse(field, "'~' paths are not allowed; name a file under the configured roots")
    rel = PurePosixPath(value.replace("\\", "/"))
    if rel.is_absolute():
        raise refuse(field, "must be a relative path")
    if any(part == ".." for part in rel.parts):
        raise refuse(field, "'..' is not allowed in paths")
    if not rel.parts or rel == PurePosixPath("."):
        raise refuse(field, "is empty")
    return rel


def confine(path: Path, root: Path) -> Path | None:
    """`path` fully resolved (symlinks followed), or None when that falls outside `root`."""
    resolved = Path(os.path.realpath(path))
    return resolved if is_within(resolved, Path(os.path.realpath(root))) else None


class PathPolicy:
    """Resolves the paths of one tenant's spec against the configured roots."""

    def __init__(self, settings: ApiSettings, tenant: str):
        self.settings = settings
        self.tenant = tenant
        self.files_dir = settings.files_dir(tenant)
        self.outputs_dir = settings.outputs_dir(tenant)

    # ---- inputs --------------------------------------------------------------------------------------

    def dataset(self, field: str, value: str) -> str:
        """Absolute path of a readable dataset file named by `value`."""
        if FILE_ID_RE.fullmatch(value):
            files_dir = own_files_dir(self.settings, self.tenant)
            path = self.files_dir / f"{value}.jsonl"
            if files_dir is None or not regular_file(path):  # a link planted under an upload's name is none
                raise ApiError(422, "file_not_found", f"{field}: no uploaded file {value!r}", field=field)
            return str(path)
        return str(self._under_roots(field, value, self.settings.data_roots, "data", want_dir=False))

    def upload(self, value: Any) -> dict[str, Any] | None:
        """What POST /files recorded about an uploaded dataset (its checked format and example count), when
        `value` is a file id of this tenant's."""
        if not isinstance(value, str) or not FILE_ID_RE.fullmatch(value) or \
                own_files_dir(self.settings, self.tenant) is None or \
                not regular_file(self.files_dir / f"{value}.jsonl"):
            return None
        return read_upload_meta(self.files_dir, value)

    def model(self, field: str, value: str) -> str:
        """Absolute path of a base-model (or tokenizer) directory named by `value`."""
        if value in self.settings.model_catalogue:
            target = self.settings.model_catalogue[value]
            for root in self.settings.model_roots:
                found = confine(target, root)
                if found is not None and found.is_dir():
                    return str(found)
            raise refuse(field, f"catalogue entry {value!r} is not a directory under a model root; the operator "
                                f"sets {ENV_MODEL_CATALOGUE} and {ENV_MODEL_ROOTS}")
        return str(self._under_roots(field, value, self.settings.model_roots, "model", want_dir=True))

    def _under_roots(self, field: str, value: str, roots: list[Path], kind: str, *, want_dir: bool) -> Path:
        if not roots:
            setting = ENV_DATA_ROOTS if kind == "data" else ENV_MODEL_ROOTS
            raise refuse(field, f"this server has no {kind} roots ({setting} is not set); "
                                + ("upload the dataset with POST /files and use its file id"
                                   if kind == "data" else f"the operator sets {ENV_MODEL_ROOTS} and, for model "
                                   f"names, {ENV_MODEL_CATALOGUE}"))
        if os.path.isabs(value):
            if "\x00" in value or any(part == ".." for part in PurePosixPath(value).parts):
                raise refuse(field, "'..' is not allowed in paths")
            candidates = [(Path(value), root) for root in roots if is_within(Path(value), root)]
            if not candidates:
                raise refuse(field, f"absolute path outside the configured {kind} roots")
        else:
            rel = safe_relative(field, value)
            candidates = [(root / rel, root) for root in roots]
        for candidate, root in candidates:
            bad = problem(str(candidate), max_bytes=MAX_PATH_BYTES, path=True)
            if bad:
                raise refuse(field, f"under its root, the path {bad}; give a shorter path")
            if not os.path.lexists(candidate):
                continue
            found = confine(candidate, root)
            if found is None:
                raise refuse(field, f"resolves outside the configured {kind} roots (symlink)")
            self._not_other_tenant(field, found)
            if want_dir and found.is_dir() or not want_dir and found.is_file():
                return found
            raise refuse(field, f"is not a {'directory' if want_dir else 'file'}")
        raise ApiError(422, "path_not_found", f"{field}: {value!r} was not found under the {kind} roots",
                       field=field)

    def _not_other_tenant(self, field: str, path: Path) -> None:
        # A root that (mis)contains the tenants' namespaces must not open another tenant's files.
        for base in self.settings.namespace_roots:
            everyone = Path(os.path.realpath(base))
            own = Path(os.path.realpath(base / self.tenant))
            if is_within(path, everyone) and not is_within(path, own):
                raise refuse(field, "points into another tenant's namespace")

    # ---- outputs -------------------------------------------------------------------------------------

    def output_dir(self, value: str) -> str:
        """A tenant-named output directory, inside the tenant's output namespace."""
        rel = safe_relative("output_dir", value)
        path = self.outputs_dir / rel
        room = MAX_PATH_BYTES - OUTPUT_ROOM_BYTES
        if len(str(path).encode("utf-8")) > room:
            raise refuse("output_dir", f"inside your output namespace it is {len(str(path).encode('utf-8'))} bytes "
                                       f"long; the files a job writes there need it at {room} or fewer: choose a "
                                       "shorter path")
        if confine(path, self.outputs_dir) is None:
            raise refuse("output_dir", "resolves outside your output namespace (symlink)")
        if self.outputs_dir.exists() and plain_dir_at(self.outputs_dir, self.settings.jobs_root) is None:
            raise refuse("output_dir", "your output namespace is not a plain directory (a symbolic link?); the "
                                       "operator must replace it before jobs can write there")
        return str(path)

    def owns_output(self, output_dir: str | None) -> Path | None:
        """The resolved output directory of a job when it lies in this tenant's namespace, itself a plain
        directory of jobs_root (a link planted as `<jobs_root>/<tenant>` leads nowhere)."""
        if not output_dir or plain_dir_at(self.outputs_dir, self.settings.jobs_root) is None:
            return None
        return confine(Path(output_dir), self.outputs_dir)


def confine_spec(spec: dict[str, Any], policy: PathPolicy) -> dict[str, Any]:
    """A copy of `spec` whose paths are resolved and confined; raises ApiError (422) naming the field.

    Without an output_dir the coordinator gives the job `<jobs_root>/<tenant>/<job id>`."""
    if not isinstance(spec, dict):
        raise ApiError(422, "validation_error", "the job spec must be a JSON object", field="body")
    out = dict(spec)
    model = _section(out, "model")
    data = _section(out, "data")
    _check_uploads(data, policy, out.get("objective") or "sft")
    for section, key, resolve, required in (
        (model, "path", policy.model, True),
        (model, "tokenizer_path", policy.model, False),
        (data, "path", policy.dataset, True),
        (data, "eval_path", policy.dataset, False),
    ):
        name = f"{'model' if section is model else 'data'}.{key}"
        value = section.get(key)
        if value is None or value == "":
            if required:
                raise ApiError(422, "validation_error", f"{name} is required", field=name)
            continue
        if not isinstance(value, str):
            raise ApiError(422, "validation_error", f"{name} must be a string", field=name)
        section[key] = resolve(name, value)
    output = out.get("output_dir")
    if output is not None and not isinstance(output, str):
        raise ApiError(422, "validation_error", "output_dir must be a string", field="output_dir")
    if output:
        out["output_dir"] = policy.output_dir(output)
    else:
        out.pop("output_dir", None)
    return out


def _check_uploads(data: dict[str, Any], policy: PathPolicy, objective: str) -> None:
    """An uploaded dataset was checked in one format when it came: the job reads it in that format (auto
    takes it; another is refused), in the objective that format is for, and a held-out eval split must leave
    examples to train on."""
    from horizon_ray.jobspec import DataSpec

    train = policy.upload(data.get("path"))
    if train is None:
        return
    fmt = data.get("format") or "auto"
    if fmt == "auto":
        data["format"] = fmt = train["format"]
    elif fmt != train["format"]:
        raise ApiError(422, "validation_error", f"data.format is {fmt!r} but file {data['path']} was checked as "
                       f"{train['format']!r} when it was uploaded; set data.format to {train['format']!r} or auto",
                       field="data.format")
    if (objective == "dpo") != (fmt == PREFERENCE):
        want = "preference pairs ({\"prompt\", \"chosen\", \"rejected\"} or OpenAI's preference format)" \
            if objective == "dpo" else "demonstrations (messages, alpaca, sharegpt or text)"
        other = "sft (method supervised)" if objective == "dpo" else "dpo (method dpo)"
        raise ApiError(422, "validation_error", f"file {data['path']} holds {fmt!r} data (checked when it was "
                       f"uploaded), but objective {objective} trains on {want}; upload such a file, or train this "
                       f"one with objective {other}", field="data.path")
    held = policy.upload(data.get("eval_path"))
    if held is not None and held["format"] != fmt:
        raise ApiError(422, "validation_error", f"data.eval_path {data['eval_path']} holds {held['format']!r} "
                       f"examples but data.path holds {fmt!r}; give both files in one format",
                       field="data.eval_path")
    fraction = data.get("eval_fraction", DataSpec().eval_fraction)
    n = int(train.get("num_examples") or 0)
    if not data.get("eval_path") and isinstance(fraction, (int, float)) and 0 < fraction < 1 and n and \
            max(1, round(fraction * n)) >= n:
        raise ApiError(422, "validation_error", f"data.eval_fraction {fraction} of the {n} examples of "
                       f"{data['path']} leaves nothing to train on; upload more examples, lower eval_fraction "
                       "(0: no eval) or give an eval_path", field="data.eval_fraction")


def _section(spec: dict[str, Any], key: str) -> dict[str, Any]:
    value = spec.get(key)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ApiError(422, "validation_error", f"{key} must be an object", field=key)
    spec[key] = dict(value)
    return spec[key]
