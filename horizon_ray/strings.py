"""What a string from outside may hold: the one check every client string passes before anything keeps it.

A string that reaches the service (a job spec's field, an uploaded file's name, a path or query parameter, a
header the service stores or echoes) is refused when it holds
- an unpaired UTF-16 surrogate (JSON's ``\\ud800`` escapes spell one): it is not text, and writing it as
  UTF-8 (a file name, a response body, a log line) fails later, far from where it came in;
- NUL or another control character (Unicode category Cc: C0, DEL, C1): NUL ends a path at the kernel, a
  newline forges lines in logs and in the job's event stream;
- an invisible formatting character (category Cf: bidi controls such as U+202E, zero-width characters, the
  byte-order mark U+FEFF) or a line or paragraph separator (U+2028, U+2029): they make a name or a path show
  other than it is (`acme-\u202egnp.exe` reads as `acme-exe.png`), or split a line where a viewer shows one;
- more UTF-8 bytes than its limit; for a path, a component longer than a file name can be (NAME_MAX) or a
  whole path longer than the kernel takes (PATH_MAX).

Refusals are ``BadInput`` naming the field and the fix; ``problem`` says what is wrong without raising, for
callers that raise their own error type.
"""

from __future__ import annotations

import unicodedata

from horizon_ray.errors import BadInput

MAX_COMPONENT_BYTES = 255  # NAME_MAX: the longest file name Linux filesystems take
MAX_PATH_BYTES = 4096  # PATH_MAX: the longest path the kernel takes
MAX_TEXT_BYTES = 1024  # a label (a job's name, a device, a module name): shown in lists and logs
# Room a job's output_dir leaves for what the runner writes inside it
# (checkpoints/step-00000042.tmp-<pid>/engine/<shard>.safetensors and the like).
OUTPUT_ROOM_BYTES = 512
# Unicode categories of characters that show nothing yet change what is shown: format (bidi controls,
# zero-width, BOM), line and paragraph separators
INVISIBLE_CATEGORIES = ("Cf", "Zl", "Zp")


def problem(value: str, *, max_bytes: int = MAX_TEXT_BYTES, path: bool = False) -> str | None:
    """What makes `value` unacceptable (a phrase to follow the field's name), or None when it is fine.
    `path`: also no component longer than MAX_COMPONENT_BYTES."""
    for i, ch in enumerate(value):
        if "\ud800" <= ch <= "\udfff":
            return f"holds an unpaired UTF-16 surrogate (\\u{ord(ch):04x} at character {i}), which is not text"
        category = unicodedata.category(ch)
        if category == "Cc":
            name = "a NUL character" if ch == "\x00" else f"a control character (\\x{ord(ch):02x})"
            return f"holds {name} at character {i}"
        if category in INVISIBLE_CATEGORIES:
            return (f"holds an invisible formatting character (U+{ord(ch):04X} "
                    f"{unicodedata.name(ch, 'unnamed')}) at character {i}")
    size = len(value.encode("utf-8"))
    if size > max_bytes:
        return f"is {size} bytes long (UTF-8); the limit is {max_bytes}"
    if path:
        for part in value.replace("\\", "/").split("/"):
            n = len(part.encode("utf-8"))
            if n > MAX_COMPONENT_BYTES:
                return (f"has a component of {n} bytes ({part[:24]!r}...); a file or directory name can have at "
                        f"most {MAX_COMPONENT_BYTES}")
    return None


def check_text(value: str, field: str, *, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """`value` when it is acceptable text; BadInput naming `field` otherwise."""
    bad = problem(value, max_bytes=max_bytes)
    if bad:
        raise BadInput(f"{field} {bad}; {fix(bad)}", field=field)
    return value


def check_path(value: str, field: str, *, max_bytes: int = MAX_PATH_BYTES) -> str:
    """`value` when it is an acceptable path; BadInput naming `field` otherwise."""
    bad = problem(value, max_bytes=max_bytes, path=True)
    if bad:
        raise BadInput(f"{field} {bad}; {fix(bad)}", field=field)
    return value


def fix(problem_text: str) -> str:
    """The fix for a `problem`."""
    if "component" in problem_text:
        return f"shorten that name to {MAX_COMPONENT_BYTES} bytes or fewer"
    if "bytes long" in problem_text:
        return "shorten it"
    if "invisible" in problem_text:
        return ("remove it: bidi controls, zero-width characters and byte-order marks make a name show other "
                "than it is")
    if "surrogate" in problem_text:
        return "send valid Unicode text (a character outside the BMP is a pair of \\u escapes, never one half)"
    return "send plain text without control characters"


def shown(value: object, limit: int = 60) -> str:
    """`repr(value)` cut to about `limit` characters, for echoing a client's value in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
