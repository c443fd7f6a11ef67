"""The ports the integration tests hand to the servers they start (tests.serving.free_port): never of the
kernel's ephemeral range, which any outgoing connection or bind(0) may take between the test's check and the
server's bind; never one that is in use; never the same one twice in a process."""

from __future__ import annotations

import socket

from tests import serving


def test_free_ports_lie_between_rays_worker_ports_and_the_ephemeral_range_and_never_repeat():
    low = serving._ephemeral_low()
    ports = [serving.free_port() for _ in range(50)]
    assert all(serving.RAY_WORKER_PORTS_END < p < low for p in ports), (ports, low)
    assert len(set(ports)) == len(ports)
    for p in ports:  # free when handed out
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draw, offered = serving._draw.randrange, []

        def taken_first(a, b):  # the draw offers the port in use first
            offered.append(taken if not offered else draw(a, b))
            return offered[-1]

        monkeypatch.setattr(serving._draw, "randrange", taken_first)
        monkeypatch.setattr(serving, "_ephemeral_low", lambda: 65536)  # the held port lies in the drawn range
        port = serving.free_port()
    assert offered[0] == taken and port != taken and port == offered[-1]
