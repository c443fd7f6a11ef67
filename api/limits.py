"""Request body size limit (413), as plain ASGI middleware so it also covers chunked bodies.

A declared Content-Length over the limit is refused before the app runs. A body without one is counted
as it streams; once it passes the limit, reading it raises ``BodyTooLarge`` and whatever the app tried
to answer is replaced by the 413.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


class BodyTooLarge(Exception):
    """The request body passed its limit while being read."""

    def __init__(self, limit: int):
        super().__init__(f"request body is larger than {limit} bytes")
        self.limit = limit


def too_large_body(limit: int) -> bytes:
    return json.dumps(
        error_body("payload_too_large", f"request body is larger than the limit of {limit} bytes")
    ).encode()


class BodyLimitMiddleware:
    """Refuse bodies larger than ``limit_for(scope)`` bytes with a JSON 413."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int]):
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _send_413(send, limit)
            return

        received = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise BodyTooLarge(limit)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                return  # the app answered after the limit tripped; the 413 below wins
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded and not started:
            await _send_413(send, limit)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(send: Send, limit: int) -> None:
    body = too_large_body(limit)
    await send({
        "type": "http.response.start",
        "status": 413,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": body})
