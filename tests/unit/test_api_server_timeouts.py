"""The API server's limits on slow clients (api.server.server_config, what `serve` and `running_server` run): a
connection whose request head is not complete within the head timeout is closed, however slowly it trickles
bytes (uvicorn has no such deadline); a request whose head came in time is never cut while the app works, and a
kept-alive connection gets the same deadline for its next head."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from fastapi import FastAPI

from api.server import HeadTimeoutH11, running_server

HEAD_S = 0.5  # the head timeout these tests run with
NEVER_S = 30.0  # what a socket waits before the test calls the server hung


@pytest.fixture
def url(monkeypatch):
    monkeypatch.setattr(HeadTimeoutH11, "head_timeout_s", HEAD_S)
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(3 * HEAD_S)  # the app works longer than the head timeout
        return {"ok": True}

    with running_server(app) as url:
        yield url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=NEVER_S)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_head_that_trickles_in_is_cut_at_the_deadline(url):
    """A byte every HEAD_S / 4, until the server closes: a deadline that each byte extended would never come.
    However late a busy machine runs the loop, the connection must end closed, unanswered, within NEVER_S."""
    with connect(url) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
        sock.settimeout(HEAD_S / 4)
        deadline = time.monotonic() + NEVER_S
        answer = None
        while answer is None:
            assert time.monotonic() < deadline, "the trickling head was never cut"
            try:
                answer = sock.recv(65536)  # b"": closed
            except TimeoutError:
                try:
                    sock.sendall(b"X")
                except (BrokenPipeError, ConnectionResetError):  # closed between two bytes
                    answer = b""
            except ConnectionResetError:  # closed while a byte was on its way
                answer = b""
        assert answer == b""  # closed, without an answer


def test_a_request_in_time_is_answered_however_long_the_app_works_and_the_next_head_has_a_deadline(url):
    with connect(url) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b'{"ok":true}' not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /slow HTTP/1.1\r\n")  # the next request on the kept-alive connection: half a head
        assert read_until_closed(sock) == b""
