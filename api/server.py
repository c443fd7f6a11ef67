"""Running the app under uvicorn: in the foreground (``serve``) or on a background thread on a port the OS picks
(``running_server``, for tests, the demo and notebooks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


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


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` until interrupted."""
    uvicorn.run(app, host=host, port=port, log_level=log_level)


@contextlib.contextmanager
def running_server(
    app: FastAPI, host: str = "127.0.0.1", port: int | None = None, *, log_level: str = "warning",
    startup_timeout_s: float = 30.0,
) -> Iterator[str]:
    """Serve `app` on a uvicorn thread; yields its base URL and stops it on exit."""
    sock = bound_socket(host, port or 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=2)
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
