"""JSONL datasets in three formats, loaded into one in-memory form.

- ``alpaca``: ``{"instruction": str, "input": str (optional), "output": str}``; becomes a user turn
  (instruction, then a blank line and input when input is non-empty) and an assistant turn (output).
- ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` with at
  least one assistant turn (the only tokens that are trained).
- ``text``: ``{"text": str}``; every token is trained.

``auto`` decides per file from its first non-blank line; every other line of that file must then have the
same format. Other keys on a line (ids, metadata) are ignored. Every malformed line raises BadInput with
``file:line`` and what is wrong, so a bad dataset fails before any compute is spent on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizon_ray.data.preference import FORMAT as PREFERENCE
from horizon_ray.data.preference import is_preference, parse_pair
from horizon_ray.errors import BadInput
from horizon_ray.jobspec import DATA_FORMATS

FORMATS = DATA_FORMATS  # the job spec's data.format values
ROLES = ("system", "user", "assistant")


@dataclass
class Example:
    """One training example, before tokenization; exactly one of ``messages`` and ``text`` is set."""

    messages: list[dict[str, str]] | None  # chat turns, {"role", "content"}; alpaca lands here too
    text: str | None  # plain text, trained on every token
    source: str  # "file:line", for error messages and the eval/train split report


def _expand_paths(path: str | Path | Sequence[str | Path]) -> list[Path]:
    """A file, a folder (its *.jsonl, sorted) or a list of either, in a deterministic order."""
    items = [path] if isinstance(path, str | Path) else list(path)
    if not items:
        raise BadInput("no dataset path given; pass a .jsonl file, a folder of .jsonl files or a list")
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise BadInput(
                    f"{p}: folder holds no *.jsonl file; point the dataset path at a .jsonl file"
                )
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise BadInput(f"{p}: no such dataset file or folder; check the dataset path")
    return files


def _detect(record: dict[str, Any], where: str) -> str:
    if is_preference(record):  # before messages: OpenAI's pairs hold their prompt's messages too
        return PREFERENCE
    if "messages" in record:
        return "messages"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    raise BadInput(
        f"{where}: cannot tell the format from keys {sorted(record)}; expected 'messages' (chat), "
        "'instruction' + 'output' (alpaca), 'text', or 'prompt' + 'chosen' + 'rejected' (preference pairs), or "
        "set the format explicitly"
    )


def _read_lines(path: Path):
    """Yield (line number, parsed JSON object) for every non-blank line."""
    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield lineno, _record(raw, f"{path}:{lineno}")


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


def detect_format(path: str | Path) -> str:
    """The format of one JSONL file, from its first non-blank line: "alpaca", "messages" or "text"."""
    p = Path(path)
    for lineno, record in _read_lines(p):
        return _detect(record, f"{p}:{lineno}")
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


def _parse_alpaca(record: dict[str, Any], where: str) -> Example:
    instruction = _string(record, "instruction", where)
    extra = _string(record, "input", where, required=False, nonempty=False)
    output = _string(record, "output", where)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return Example([{"role": "user", "content": user}, {"role": "assistant", "content": output}], None, where)


def message_list(turns: Any, where: str, key: str = "messages") -> list[dict[str, str]]:
    """A non-empty list of {role, content} turns (the other keys of a turn dropped); BadInput naming the turn."""
    if not isinstance(turns, list) or not turns:
        raise BadInput(f"{where}: '{key}' must be a non-empty list of {{role, content}} objects")
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadInput(f"{where}: {key}[{i}] must be an object with 'role' and 'content'")
        role = turn.get("role")
        if role not in ROLES:
            raise BadInput(f"{where}: {key}[{i}] has role {role!r}; use one of {', '.join(ROLES)}")
        content = turn.get("content")
        if not isinstance(content, str):
            raise BadInput(f"{where}: {key}[{i}] content must be a string, got {type(content).__name__}")
        _encodable(content, where, f"{key}[{i}] content")
        messages.append({"role": role, "content": content})
    return messages


def _parse_messages(record: dict[str, Any], where: str) -> Example:
    messages = message_list(record.get("messages"), where)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadInput(f"{where}: no assistant message, so nothing to train on; add the assistant's answer")
    return Example(messages, None, where)


def _parse_text(record: dict[str, Any], where: str) -> Example:
    return Example(None, _string(record, "text", where), where)


_PARSERS = {"alpaca": _parse_alpaca, "messages": _parse_messages, "text": _parse_text, PREFERENCE: parse_pair}


class LineChecker:
    """Checks a JSONL dataset as its bytes arrive (an upload), line by line, with the rules of ``load_file``,
    keeping nothing but a count and the line being read: memory stays within `max_line_bytes` whatever the size
    of the file. ``feed`` each chunk, then ``finish`` for (format, number of examples); BadInput naming
    ``name:line`` as soon as a line is wrong."""

    def __init__(self, fmt: str, name: str, max_line_bytes: int):
        if fmt not in FORMATS:
            raise BadInput(f"unknown dataset format {fmt!r}; use one of {', '.join(FORMATS)}")
        self.auto = fmt == "auto"
        self.fmt = None if self.auto else fmt  # the file's format, once known
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
            raise BadInput(f"{self.name}: holds no example; add JSONL lines in alpaca, messages or text format")
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
        found = _detect(record, where) if self.auto else self.fmt
        if self.fmt is None:
            self.fmt = found
        elif found != self.fmt:
            raise BadInput(f"{where}: line is {found} but the file was detected as {self.fmt} from its first line; "
                           "keep one format per file")
        _PARSERS[self.fmt](record, where)
        self.count += 1


def load_file(path: str | Path, fmt: str = "auto") -> list[Example]:
    """Every example of one JSONL file; ``fmt="auto"`` detects it from the first non-blank line."""
    return list(iter_file(path, fmt))


def iter_file(path: str | Path, fmt: str = "auto") -> Iterator[Example]:
    """The examples of one JSONL file one at a time, with the rules of ``load_file``: a reader that keeps none
    of them holds one line in memory whatever the file's size."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown dataset format {fmt!r}; use one of {', '.join(FORMATS)}")
    p = Path(path)
    file_fmt = detect_format(p) if fmt == "auto" else fmt
    if file_fmt == PREFERENCE:
        raise BadInput(f"{p} holds preference pairs (prompt, chosen, rejected), which objective sft does not read: "
                       "set objective: dpo, or give SFT data", field="data.path")
    parse = _PARSERS[file_fmt]
    for lineno, record in _read_lines(p):
        where = f"{p}:{lineno}"
        if fmt == "auto" and _detect(record, where) != file_fmt:
            raise BadInput(
                f"{where}: line is {_detect(record, where)} but the file was detected as {file_fmt} from its "
                "first line; keep one format per file"
            )
        yield parse(record, where)


def load_examples(path: str | Path | Sequence[str | Path], fmt: str = "auto") -> list[Example]:
    """Every example of a JSONL file, a folder of them, or a list; refuses a dataset with no example."""
    files = _expand_paths(path)
    examples: list[Example] = []
    for f in files:
        examples.extend(load_file(f, fmt))
    if not examples:
        names = ", ".join(str(f) for f in files)
        raise BadInput(
            f"dataset {names} holds no example; add JSONL lines in alpaca, messages or text format"
        )
    return examples
