"""Datasets in four formats, JSONL or a ``.json`` array of records, loaded into one in-memory form.

- ``alpaca``: ``{"instruction": str, "input": str (optional), "output": str, "system": str (optional)}``;
  becomes a user turn (instruction, then a blank line and input when input is non-empty) and an assistant
  turn (output), after a system turn when ``system`` is given.
- ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str, "weight": 0|1}, ...]}``
  with at least one trained assistant turn (the only tokens that are trained; OpenAI's per-message ``weight``
  0 leaves an assistant turn out of the loss).
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...], "system": str}``;
  the roles map onto system/user/assistant (``SHAREGPT_ROLES``, and ``data.roles`` for others).
- ``text``: ``{"text": str}``; every token is trained.

A ``Layout`` (the spec's ``data.columns`` and ``data.roles``, like LLaMA-Factory's ``dataset_info`` columns and
tags or axolotl's ``field_messages`` and ``message_property_mappings``) renames the keys a format reads and maps
role values. ``auto`` decides per file from its first record; every other record must then have the same
format. Other keys (ids, metadata) are ignored. Every malformed record raises BadInput with ``file:line`` and
what is wrong (in a ``.json`` array, the line its record starts on), so a bad dataset fails before any compute
is spent on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from horizon_ray.data.preference import FORMAT as PREFERENCE
from horizon_ray.data.preference import PreferencePair, is_preference, parse_pair
from horizon_ray.engine.sampling import CHAT_ROLES
from horizon_ray.errors import BadInput
from horizon_ray.jobspec import DATA_FORMATS

FORMATS = DATA_FORMATS  # the job spec's data.format values
ROLES = CHAT_ROLES
# ShareGPT's role values (LLaMA-Factory's default tags) and the chat roles they are
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
# the keys each format reads, by their canonical names (the spec's data.columns renames them)
DEFAULT_COLUMNS = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
    "messages": {"messages": "messages", "role": "role", "content": "content", "weight": "weight"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value", "weight": "weight",
                 "system": "system"},
    "text": {"text": "text"},
}
COLUMNS = tuple(sorted({c for cols in DEFAULT_COLUMNS.values() for c in cols}))
SUFFIXES = (".jsonl", ".json")  # the files a dataset folder contributes


@dataclass(frozen=True)
class Layout:
    """Where records keep their fields: canonical column -> the file's key (data.columns), and the file's role
    values -> system|user|assistant (data.roles, over the format's own: SHAREGPT_ROLES for sharegpt)."""

    columns: Mapping[str, str] = field(default_factory=dict)
    roles: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.columns:
            if name not in COLUMNS:
                raise BadInput(f"data.columns has no column {name!r}; use {', '.join(COLUMNS)}", field="data.columns")
        for value, role in self.roles.items():
            if role not in ROLES:
                raise BadInput(f"data.roles maps {value!r} to {role!r}; map each role value to one of "
                               f"{', '.join(ROLES)}", field="data.roles")

    def key(self, fmt: str, column: str) -> str:
        return self.columns.get(column) or DEFAULT_COLUMNS[fmt][column]

    def role(self, fmt: str, value: Any) -> str | None:
        """The chat role of a file's role value, or None when it has none."""
        table = {**(SHAREGPT_ROLES if fmt == "sharegpt" else {r: r for r in ROLES}), **self.roles}
        return table.get(value) if isinstance(value, str) else None


PLAIN = Layout()


def layout_of(data: Any) -> Layout:
    """The Layout a job spec's data section (DataSpec) asks for."""
    columns = {k: v for k, v in data.columns.model_dump().items() if v} if data.columns else {}
    return Layout(columns, dict(data.roles or {}))


@dataclass
class Example:
    """One training example, before tokenization; exactly one of ``messages`` and ``text`` is set."""

    messages: list[dict[str, str]] | None  # chat turns, {"role", "content"}; alpaca lands here too
    text: str | None  # plain text, trained on every token
    source: str  # "file:line", for error messages and the eval/train split report
    untrained: tuple[int, ...] = ()  # indices of assistant turns left out of the loss (weight 0)


def _expand_paths(path: str | Path | Sequence[str | Path]) -> list[Path]:
    """A file, a folder (its *.jsonl and *.json, sorted) or a list of either, in a deterministic order."""
    items = [path] if isinstance(path, str | Path) else list(path)
    if not items:
        raise BadInput("no dataset path given; pass a .jsonl file, a folder of .jsonl files or a list")
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
            if not found:
                raise BadInput(
                    f"{p}: folder holds no *.jsonl or *.json file; point the dataset path at a .jsonl file"
                )
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise BadInput(f"{p}: no such dataset file or folder; check the dataset path")
    return files


def _detect(record: dict[str, Any], where: str, layout: Layout = PLAIN) -> str:
    if is_preference(record):  # before messages: OpenAI's pairs hold their prompt's messages too
        return PREFERENCE
    if layout.key("messages", "messages") in record:
        return "messages"
    if layout.key("sharegpt", "messages") in record:
        return "sharegpt"
    if layout.key("alpaca", "instruction") in record and layout.key("alpaca", "output") in record:
        return "alpaca"
    if layout.key("text", "text") in record:
        return "text"
    raise BadInput(
        f"{where}: cannot tell the format from keys {sorted(record)}; expected 'messages' (chat), "
        "'conversations' (sharegpt), 'instruction' + 'output' (alpaca) or 'text', or set data.format "
        f"({', '.join(f for f in FORMATS if f != 'auto')}) and name the file's keys in data.columns"
    )


def _read_lines(path: Path):
    """Yield (line number, parsed JSON object) for every record: each non-blank line of a JSONL file, each
    element of a ``.json`` file's array (numbered by the line it starts on)."""
    if path.suffix == ".json":
        yield from _read_array(path)
        return
    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield lineno, _record(raw, f"{path}:{lineno}")


def _read_array(path: Path):
    """The records of a JSON array file, each with the line it starts on."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos, line = _skip_space(text, 0), 1

    def at(i: int) -> int:  # the line of character i, counted on from the last position asked
        nonlocal pos, line
        line += text.count("\n", pos, i)
        pos = i
        return line

    if not text.strip():
        return
    if text[pos] != "[":
        raise BadInput(f"{path}:{at(pos)}: a .json dataset must be an array of records ([{{...}}, ...]); write "
                       "one, or one JSON object per line in a .jsonl file")
    i = _skip_space(text, pos + 1)
    if text.startswith("]", i):
        return
    while True:
        where = f"{path}:{at(i)}"
        try:
            record, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{exc.lineno}: not valid JSON at column {exc.colno}: "
                           f"{exc.msg.removesuffix(' at')}; fix the record") from None
        except RecursionError:
            raise BadInput(f"{where}: JSON nested too deeply to read; fix the record") from None
        if not isinstance(record, dict):
            raise BadInput(f"{where}: expected a JSON object per array element, got {type(record).__name__}; "
                           "fix the record")
        yield line, record
        i = _skip_space(text, end)
        if text.startswith("]", i):
            if text[i + 1:].strip():
                raise BadInput(f"{path}:{at(i)}: text after the array's closing ']'; remove it")
            return
        if not text.startswith(",", i):
            raise BadInput(f"{path}:{at(i)}: expected ',' or ']' after a record of the array; fix the file")
        i = _skip_space(text, i + 1)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _record(raw: str, where: str) -> dict[str, Any]:
    """One line's JSON object; BadInput naming the line otherwise."""
    try:
        # without its line ending: a line cut short would otherwise fail "at column 1" of a next line
        record = json.loads(raw.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        what = exc.msg.removesuffix(" at")  # "Unterminated string starting at": the column says where
        raise BadInput(f"{where}: not valid JSON at column {exc.colno}: {what}; fix the line") from None
    except RecursionError:
        raise BadInput(f"{where}: JSON nested too deeply to read; fix the line") from None
    if not isinstance(record, dict):
        raise BadInput(f"{where}: expected a JSON object per line, got {type(record).__name__}; fix the line")
    return record


def detect_format(path: str | Path, layout: Layout = PLAIN) -> str:
    """The format of one dataset file, from its first record: "alpaca", "messages", "sharegpt" or "text"."""
    p = Path(path)
    for lineno, record in _read_lines(p):
        return _detect(record, f"{p}:{lineno}", layout)
    raise BadInput(f"{p}: file holds no example (empty or only blank lines); add examples or drop the file")


def _encodable(value: str, where: str, what: str) -> None:
    """Text the tokenizer can take: JSON escapes can spell a lone UTF-16 surrogate, which is not text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise BadInput(f"{where}: {what} holds an unpaired UTF-16 surrogate (\\u{ord(bad):04x} at character "
                       f"{exc.start}); fix the text") from None


def _string(
    record: dict[str, Any], key: str, where: str, required: bool = True, nonempty: bool = True
) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if value is None:
        raise BadInput(f"{where}: missing '{key}'; every line of this file needs it")
    if not isinstance(value, str):
        raise BadInput(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    _encodable(value, where, f"'{key}'")
    if nonempty and not value.strip():
        raise BadInput(f"{where}: '{key}' is empty; give it text or remove the line")
    return value


def _parse_alpaca(record: dict[str, Any], where: str, layout: Layout = PLAIN) -> Example:
    instruction = _string(record, layout.key("alpaca", "instruction"), where)
    extra = _string(record, layout.key("alpaca", "input"), where, required=False, nonempty=False)
    output = _string(record, layout.key("alpaca", "output"), where)
    system = _string(record, layout.key("alpaca", "system"), where, required=False, nonempty=False)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    head = [{"role": "system", "content": system}] if system.strip() else []
    return Example([*head, {"role": "user", "content": user}, {"role": "assistant", "content": output}], None, where)


def _parse_chat(fmt: str, record: dict[str, Any], where: str, layout: Layout) -> Example:
    """messages and sharegpt: a list of turns under one key, each a role and a content (and a weight)."""
    key, role_key, content_key, weight_key = (layout.key(fmt, c) for c in ("messages", "role", "content", "weight"))
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise BadInput(f"{where}: '{key}' must be a non-empty list of {{{role_key}, {content_key}}} objects")
    messages: list[dict[str, str]] = []
    system_key = layout.key(fmt, "system") if fmt == "sharegpt" else None
    if system_key:
        system = _string(record, system_key, where, required=False, nonempty=False)
        if system.strip():
            messages.append({"role": "system", "content": system})
    untrained: list[int] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadInput(f"{where}: {key}[{i}] must be an object with '{role_key}' and '{content_key}'")
        role = layout.role(fmt, turn.get(role_key))
        if role is None:
            known = sorted({**(SHAREGPT_ROLES if fmt == "sharegpt" else dict.fromkeys(ROLES)), **layout.roles})
            raise BadInput(f"{where}: {key}[{i}] has {role_key} {turn.get(role_key)!r}; use one of "
                           f"{', '.join(known)}, or map it in data.roles (e.g. {{{turn.get(role_key)!r}: user}})")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise BadInput(f"{where}: {key}[{i}] {content_key} must be a string, got {type(content).__name__}")
        _encodable(content, where, f"{key}[{i}] {content_key}")
        weight = turn.get(weight_key)
        if weight is not None:
            if role != "assistant" or weight not in (0, 1) or isinstance(weight, bool):
                raise BadInput(f"{where}: {key}[{i}] has {weight_key} {weight!r}; a weight is 0 (not trained) or "
                               "1 (trained), on assistant turns only")
            if weight == 0:
                untrained.append(len(messages))
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadInput(f"{where}: no assistant message, so nothing to train on; add the assistant's answer")
    if all(m["role"] != "assistant" or i in untrained for i, m in enumerate(messages)):
        raise BadInput(f"{where}: every assistant message has weight 0, so nothing to train on; give one weight 1 "
                       "or drop the line")
    return Example(messages, None, where, tuple(untrained))


def _parse_messages(record: dict[str, Any], where: str, layout: Layout = PLAIN) -> Example:
    return _parse_chat("messages", record, where, layout)


def _parse_sharegpt(record: dict[str, Any], where: str, layout: Layout = PLAIN) -> Example:
    return _parse_chat("sharegpt", record, where, layout)


def _parse_text(record: dict[str, Any], where: str, layout: Layout = PLAIN) -> Example:
    return Example(None, _string(record, layout.key("text", "text"), where), where)


_SFT_PARSERS: dict[str, Callable[[dict[str, Any], str, Layout], Example]] = {
    "alpaca": _parse_alpaca, "messages": _parse_messages, "sharegpt": _parse_sharegpt, "text": _parse_text}
_PARSERS: dict[str, Callable[[dict[str, Any], str, Layout], Example | PreferencePair]] = {
    **_SFT_PARSERS, PREFERENCE: parse_pair}


class LineChecker:
    """Checks a JSONL dataset as its bytes arrive (an upload), line by line, with the rules of ``load_file``,
    keeping nothing but a count and the line being read: memory stays within `max_line_bytes` whatever the size
    of the file. ``feed`` each chunk, then ``finish`` for (format, number of examples); BadInput naming
    ``name:line`` as soon as a line is wrong."""

    def __init__(self, fmt: str, name: str, max_line_bytes: int):
        if fmt not in FORMATS:
            raise BadInput(f"unknown dataset format {fmt!r}; use one of {', '.join(FORMATS)}")
        self.auto = fmt == "auto"
        self.fmt: str | None = None if self.auto else fmt  # the file's format, once known
        self.name = name
        self.max_line_bytes = max_line_bytes
        self.count = 0  # examples checked
        self._lineno = 0  # lines complete so far
        self._partial = bytearray()  # the line being received

    def feed(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                self._partial += chunk[start:]
                if len(self._partial) > self.max_line_bytes:
                    raise BadInput(f"{self.name}:{self._lineno + 1}: line is longer than {self.max_line_bytes} bytes, "
                                   "the longest this server checks; split the example or shorten it")
                return
            if self._partial:
                self._partial += chunk[start:end]
                line, self._partial = bytes(self._partial), bytearray()
            else:
                line = chunk[start:end]
            self._line(line)
            start = end + 1

    def finish(self) -> tuple[str, int]:
        """(format, number of examples) of the whole file; BadInput when it holds no example."""
        if self._partial:  # a last line without a newline
            line, self._partial = bytes(self._partial), bytearray()
            self._line(line)
        if not self.count:
            raise BadInput(f"{self.name}: holds no example; add JSONL lines in alpaca, messages, sharegpt or text "
                           "format")
        assert self.fmt is not None, "the first example's line set it"
        return self.fmt, self.count

    def _line(self, raw: bytes) -> None:
        self._lineno += 1
        where = f"{self.name}:{self._lineno}"
        if len(raw) > self.max_line_bytes:
            raise BadInput(f"{where}: line is longer than {self.max_line_bytes} bytes, the longest this server "
                           "checks; split the example or shorten it")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"{where}: not UTF-8 text; upload a UTF-8 JSONL file") from None
        if not text.strip():
            return
        record = _record(text, where)
        found = _detect(record, where) if self.auto or self.fmt is None else self.fmt
        if self.fmt is None:
            self.fmt = found
        elif found != self.fmt:
            raise BadInput(f"{where}: line is {found} but the file was detected as {self.fmt} from its first line; "
                           "keep one format per file")
        _PARSERS[self.fmt](record, where, PLAIN)
        self.count += 1


def load_file(path: str | Path, fmt: str = "auto", layout: Layout = PLAIN) -> list[Example]:
    """Every example of one dataset file; ``fmt="auto"`` detects it from the first record."""
    return list(iter_file(path, fmt, layout))


def iter_file(path: str | Path, fmt: str = "auto", layout: Layout = PLAIN) -> Iterator[Example]:
    """The examples of one dataset file one at a time, with the rules of ``load_file``: a reader that keeps none
    of them holds one line of a JSONL file in memory whatever the file's size (a ``.json`` array is read
    whole)."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown dataset format {fmt!r}; use one of {', '.join(FORMATS)}")
    p = Path(path)
    file_fmt = detect_format(p, layout) if fmt == "auto" else fmt
    if file_fmt == PREFERENCE:
        raise BadInput(f"{p} holds preference pairs (prompt, chosen, rejected), which objective sft does not read: "
                       "set objective: dpo, or give SFT data", field="data.path")
    parse = _SFT_PARSERS[file_fmt]
    for lineno, record in _read_lines(p):
        where = f"{p}:{lineno}"
        if fmt == "auto" and (found := _detect(record, where, layout)) != file_fmt:
            raise BadInput(
                f"{where}: line is {found} but the file was detected as {file_fmt} from its "
                "first line; keep one format per file"
            )
        yield parse(record, where, layout)


def load_examples(path: str | Path | Sequence[str | Path], fmt: str = "auto",
                  layout: Layout = PLAIN) -> list[Example]:
    """Every example of a dataset file, a folder of them, or a list; refuses a dataset with no example."""
    files = _expand_paths(path)
    examples: list[Example] = []
    for f in files:
        examples.extend(load_file(f, fmt, layout))
    if not examples:
        names = ", ".join(str(f) for f in files)
        raise BadInput(
            f"dataset {names} holds no example; add records in alpaca, messages, sharegpt or text format"
        )
    return examples
