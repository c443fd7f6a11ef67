"""Running the app under uvicorn: in the foreground (``serve``) or on a background thread with a free port
(``running_server``, for tests, the demo and notebooks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` until interrupted."""
    uvicorn.run(app, host=host, port=port, log_level=log_level)


@contextlib.contextmanager
def running_server(
    app: FastAPI, host: str = "127.0.0.1", port: int | None = None, *, log_level: str = "warning",
    startup_timeout_s: float = 30.0,
) -> Iterator[str]:
    """Serve `app` on a uvicorn thread; yields its base URL and stops it on exit."""
    port = port or free_port(host)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)  # off the main thread uvicorn installs no signal handlers
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
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
