"""The API's edges around storage and slow or vanishing clients: a full disk is 507 with Retry-After and /readyz
not ready (it was a 500 and ready); upload parts left by a killed server are swept at start and the parts in
flight count against the tenant's quota; a client that leaves mid-upload is an ordinary end, logged as such (it
was an unhandled error); a body that stalls is cut with a 408. In-process, over the testbed."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time

import pytest
from fastapi.testclient import TestClient

from api import cluster_routes, files
from api.app import create_app
from api.limits import BodyLimitMiddleware
from api.testing import make_testbed

LINE = b'{"text": "hello"}\n'


@pytest.fixture
def bed(tmp_path):
    bed = make_testbed(tmp_path, max_file_bytes_per_tenant=4096)
    yield bed
    bed.close()


def upload(http, bed, body=LINE * 4):
    return http.post("/files", content=body, headers={**bed.auth("acme"), "Content-Type": "application/x-ndjson"})


def test_parts_left_by_a_killed_server_are_swept_at_start_and_parts_in_flight_count(bed):
    acme = bed.settings.uploads_dir / "acme"
    acme.mkdir(parents=True)
    stale, live = acme / ".file-000000000000000000000001.part", acme / ".file-000000000000000000000002.part"
    stale.write_bytes(b"x" * 3000)
    live.write_bytes(b"y" * 3000)
    old = time.time() - files.STALE_UPLOAD_S - 60
    os.utime(stale, (old, old))
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
        assert not stale.exists() and live.exists()  # swept when the app started; the live one is left
        # 3000 bytes in flight of the 4096 allowed: 1,200 more are past the quota, 100 are within it
        r = upload(http, bed, LINE * 70)
        assert r.status_code == 429 and "max_file_bytes_per_tenant" in r.json()["error"]["message"], r.text
        assert upload(http, bed, LINE * 5).status_code == 201
        old = time.time() - files.STALE_UPLOAD_S - 60
        os.utime(live, (old, old))  # its upload never finished: the next upload of the tenant sweeps it
        assert upload(http, bed, LINE * 70).status_code == 201 and not live.exists()


def test_a_full_disk_is_507_with_retry_after_and_readyz_says_not_ready(bed, monkeypatch, caplog):
    def full(fd, chunk, checker):
        raise OSError(errno.ENOSPC, "No space left on device")

    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
        assert http.get("/readyz").status_code == 200
        monkeypatch.setattr(files, "_write_and_check", full)
        with caplog.at_level(logging.INFO):
            r = upload(http, bed)
        assert r.status_code == 507 and r.headers["Retry-After"] == "300", r.text
        assert r.json()["error"]["code"] == "insufficient_storage"
        assert not [x for x in caplog.records if x.levelno >= logging.ERROR]  # no traceback: a known state
        assert list((bed.settings.uploads_dir / "acme").iterdir()) == []  # nothing half-written kept
        monkeypatch.setattr(cluster_routes, "MIN_FREE_BYTES", 1 << 62)  # every filesystem is "full" now
        r = http.get("/readyz")
        assert r.status_code == 503 and r.headers["Retry-After"] == "300"
        assert "storage for uploads is full" in r.json()["error"]["message"]


def _asgi_upload(app, bed, messages):
    """Run POST /files on `app` with the request body messages given (then nothing more); returns what it sent."""
    sent = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/files", "raw_path": b"/files", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {bed.keys['acme']}".encode()),
                         (b"content-type", b"application/x-ndjson"), (b"host", b"test")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.Event().wait()  # a client that sends nothing more and stays

    async def send(message):
        sent.append(message)

    async def main():
        async with app.router.lifespan_context(app):
            await app(scope, receive, send)

    asyncio.run(main())
    return sent


def test_a_client_leaving_mid_upload_is_an_ordinary_end_logged_as_such(bed, caplog):
    app = create_app(bed.client, bed.settings)
    with caplog.at_level(logging.INFO):
        sent = _asgi_upload(app, bed, [{"type": "http.request", "body": LINE * 3, "more_body": True},
                                       {"type": "http.disconnect"}])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert "client disconnected during POST /files" in [r.getMessage() for r in caplog.records]
    assert sent[0]["status"] == 400
    assert list((bed.settings.uploads_dir / "acme").iterdir()) == []  # its part is gone


def test_a_body_that_stalls_is_cut_with_a_408(bed):
    app = create_app(bed.client, bed.settings)
    inner = app.build_middleware_stack()
    stalled = BodyLimitMiddleware(inner, limit_for=lambda scope: 1 << 20, idle_timeout_s=0.2)
    app.middleware_stack = stalled  # the app's own stack, with a short idle timeout
    sent = _asgi_upload(app, bed, [{"type": "http.request", "body": LINE, "more_body": True}])
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert b"request_timeout" in sent[1]["body"]
    assert list((bed.settings.uploads_dir / "acme").iterdir()) == []
