"""Types of the path, query and header parameters the API reads: each string is checked at the edge
(``horizon_ray.strings``: no unpaired surrogate, no NUL or control character, a bounded length), so that
nothing a route stores or echoes can break a later read. A refusal is a 422 naming the parameter."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from horizon_ray.strings import MAX_COMPONENT_BYTES, MAX_PATH_BYTES, MAX_TEXT_BYTES, fix, problem


def _checker(max_bytes: int, path: bool = False):
    def check(value: str) -> str:
        bad = problem(value, max_bytes=max_bytes, path=path)
        if bad:
            raise PydanticCustomError("unsafe_string", "{problem}; {fix}", {"problem": bad, "fix": fix(bad)})
        return value

    return AfterValidator(check)


def _decimal(value: str) -> str:
    text = value.strip()
    if not (text.isascii() and text.isdecimal() and len(text) <= 19):
        raise PydanticCustomError("not_an_event_id", "is not an event id this server sent (a decimal number); "
                                                     "reconnect without it, or with the id of the last event seen")
    return text


# An identifier or a label: a job id, a file id, a page cursor, an idempotency key.
SafeText = Annotated[str, _checker(MAX_TEXT_BYTES)]
# A file's name (one path component).
FileName = Annotated[str, _checker(MAX_COMPONENT_BYTES)]
# A relative path inside a job's outputs.
SafePath = Annotated[str, _checker(MAX_PATH_BYTES, path=True)]
# An SSE Last-Event-ID: the decimal event sequence numbers this server sends.
EventId = Annotated[str, AfterValidator(_decimal)]
