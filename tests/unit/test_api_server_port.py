"""The socket `horizon-ray serve` hands the API (api.server.listening_socket): bound and listening before serve
prints its port, so that --port 0 serves on the port the OS picked and a client that read it connects at once;
a port in use is refused with the fix, not a traceback from uvicorn's bind."""

from __future__ import annotations

import socket

import pytest

from api.server import listening_socket
from horizon_ray.errors import BadInput


def test_port_0_listens_on_the_port_the_os_picked_before_any_server_accepts():
    sock = listening_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0
        # no server accepts yet: the connection waits in the backlog, it is not refused
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            accepted, _ = sock.accept()
            with accepted:
                assert accepted.recv(64).startswith(b"GET /readyz")
    finally:
        sock.close()


def test_a_port_in_use_is_refused_with_the_fix():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(BadInput, match=rf"cannot listen on 127\.0\.0\.1:{port} .*--port 0 for a free one"):
            listening_socket("127.0.0.1", port)
