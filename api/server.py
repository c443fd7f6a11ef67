"""Running the app under uvicorn: in the foreground (``serve``) or on a background thread on a port the OS picks
(``running_server``, for tests, the demo and notebooks), both with ``server_config``'s limits on slow clients:
a request's head must arrive within ``HEAD_TIMEOUT_S`` (uvicorn has no such deadline: a client sending its head
a byte at a time held a connection as long as it liked), an idle keep-alive connection closes after
``KEEP_ALIVE_S``, and a head larger than ``MAX_HEAD_BYTES`` is refused. A body that stalls is cut by the app
itself (``api.limits``), under any server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from horizon_ray.errors import BadInput

log = logging.getLogger("horizon_ray.api")
HEAD_TIMEOUT_S = 20.0  # from a connection's start (or its previous response) to its next request's whole head
KEEP_ALIVE_S = 5.0  # an idle keep-alive connection closes after this
MAX_HEAD_BYTES = 16 << 10  # a request's head (line and headers) larger than this is refused


class HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head: a connection whose next head is not
    complete HEAD_TIMEOUT_S after it opened (or after its previous response) is closed. The timer is not
    extended by data: a client trickling a byte a second gets no longer than one that sends nothing."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._cancel_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_head(self) -> None:
        self._cancel_head()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_request() or self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head came: a slow client
            log.info("closed a connection from %s: no complete request head within %.0f s", self.client,
                     self.head_timeout_s)
        self.transport.close()


def server_config(app: FastAPI, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration for the API, with the limits on slow clients of the module doc."""
    return uvicorn.Config(app, host=host, port=port, http=HeadTimeoutH11, timeout_keep_alive=int(KEEP_ALIVE_S),
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, **kwargs)


def bound_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready socket on `host`:`port` (0: the OS picks a free port), held until the server takes it:
    a port found free and released again may be taken by another process before the server binds it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int) -> socket.socket:
    """`bound_socket` listening already (connections wait in its backlog until the server accepts them), so
    that a port printed from it takes connections at once; a port in use is refused with the fix."""
    try:
        sock = bound_socket(host, port)
    except OSError as exc:
        raise BadInput(f"the API cannot listen on {host}:{port} ({exc.strerror}): pass another --port, or --port 0 "
                       "for a free one (serve prints it and writes it to <root>/api_port)") from exc
    sock.listen(2048)  # uvicorn's default backlog
    return sock


def serve(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve `app` on the listening `sock` until interrupted (`horizon-ray serve`)."""
    host, port = sock.getsockname()[:2]
    uvicorn.Server(server_config(app, host, port, log_level=log_level)).run(sockets=[sock])


@contextlib.contextmanager
def running_server(
    app: FastAPI, host: str = "127.0.0.1", port: int | None = None, *, log_level: str = "warning",
    startup_timeout_s: float = 30.0,
) -> Iterator[str]:
    """Serve `app` on a uvicorn thread; yields its base URL and stops it on exit."""
    sock = bound_socket(host, port or 0)
    port = sock.getsockname()[1]
    config = server_config(app, host, port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)  # off the main thread uvicorn installs no signal handlers
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"uvicorn did not start on {host}:{port} within {startup_timeout_s} s")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
