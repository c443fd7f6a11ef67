"""Request body size limit (413) and idle timeout (408), as plain ASGI middleware so it also covers chunked
bodies and every server that runs the app.

A declared Content-Length over the limit is refused before the app runs. A body without one is counted
as it streams; once it passes the limit, reading it raises ``BodyTooLarge`` and whatever the app tried
to answer is replaced by the 413. A body whose next chunk does not come within ``BODY_IDLE_TIMEOUT_S`` (a
client that stalls, or trickles a byte at a time between long pauses, holding a connection and an upload slot)
is cut the same way, with a 408 and the connection closed.

Before a 413 goes out, the rest of the body the client is sending is read and dropped, up to
``DRAIN_MAX_BYTES`` or ``DRAIN_MAX_S``: a server that closes a connection with bytes unread makes the kernel
reset it, and a client that sends its whole request before reading (curl, httpx, requests) then gets
``Connection reset by peer`` instead of the answer. A client that sent ``Expect: 100-continue`` has sent no
body yet and gets the 413 at once; one sending more than the bound is cut (its answer may be lost then).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body

BODY_IDLE_TIMEOUT_S = 60.0  # longest wait for the next chunk of a request body
DRAIN_MAX_BYTES = 16 << 20  # most of a refused body read (and dropped) so the client can read the 413
DRAIN_MAX_S = 10.0  # longest time spent reading a refused body


class BodyIdle(Exception):
    """No chunk of the request body came within the idle timeout."""


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

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int], idle_timeout_s: float = BODY_IDLE_TIMEOUT_S):
        self.app = app
        self.limit_for = limit_for
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            if not _expects_continue(scope):
                await _drain(receive)
            await _send_413(send, limit)
            return

        received = 0
        exceeded = idle = body_done = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded, idle, body_done
            if body_done:  # after the body, a receive waits for the client to leave (streams): no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout_s)
            except TimeoutError:
                idle = True
                raise BodyIdle() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    exceeded = True
                    raise BodyTooLarge(limit)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded or idle:
                return  # the app answered after the limit or the timeout tripped; the 413 or 408 below wins
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not (exceeded or idle):
                raise
        if exceeded and not started:
            if not body_done:
                await _drain(receive)
            await _send_413(send, limit)
        elif idle and not started:
            await _send_error(send, 408, "request_timeout", f"no part of the request body came for "
                              f"{self.idle_timeout_s:.0f} s; send it without pauses")


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a request body, up to DRAIN_MAX_BYTES and DRAIN_MAX_S (the module doc)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_MAX_S
    drained = 0
    while drained <= DRAIN_MAX_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _expects_continue(scope: Scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope.get("headers", ()))


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(send: Send, limit: int) -> None:
    await _send(send, 413, too_large_body(limit))


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    await _send(send, status, json.dumps(error_body(code, message)).encode())


async def _send(send: Send, status: int, body: bytes) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": body})
