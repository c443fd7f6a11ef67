"""`horizon-ray status --address` to an address where no Ray cluster listens: a message within seconds, exit 2,
no Ray retries (Ray alone retries the GCS for minutes, printing its warnings)."""

from __future__ import annotations

import socket
import time

from horizon_ray.cli import main
from horizon_ray.commands import status


def test_status_to_a_wrong_address_says_so_at_once(capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setattr(status, "connect", lambda args: (_ for _ in ()).throw(AssertionError("no Ray call")))
    t0 = time.monotonic()
    assert main(["status", "--address", f"127.0.0.1:{port}"]) == 2
    assert time.monotonic() - t0 < status.CONNECT_TIMEOUT_S + 5
    err = capsys.readouterr().err
    assert f"error: no Ray cluster answers at 127.0.0.1:{port} (Connection refused" in err and "--address" in err
    assert status._unanswered("auto") is None
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert status._unanswered(f"ray://127.0.0.1:{listening.getsockname()[1]}") is None
