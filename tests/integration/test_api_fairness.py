"""One tenant's load cannot slow the others: the streams of a job share one follower (the coordinator sees
the same calls for 1 stream or 40), a tenant's streams, request rate and uploads are capped (429 with
Retry-After, naming the setting), and an upload costs the API process the same few MiB whatever its size
(measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from api.app import create_app
from api.server import running_server
from api.testing import make_testbed

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


class Counting:
    """A coordinator client that counts the calls of each method."""

    def __init__(self, client):
        self.client = client
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def counted(*args, **kwargs):
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args, **kwargs)

        return counted

    def polls(self) -> int:
        with self._lock:
            return self.calls.get("events", 0) + self.calls.get("get", 0)


class Streams:
    """`n` SSE streams of one job, each read on its own thread until `close`."""

    def __init__(self, url: str, path: str, headers: dict, n: int):
        self.stop = threading.Event()
        self.opened = threading.Semaphore(0)
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._read, args=(url, path, headers), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()
        for _ in range(n):
            assert self.opened.acquire(timeout=60), "a stream did not open"

    def _read(self, url, path, headers):
        with httpx.Client(base_url=url, timeout=60) as http, \
                http.stream("GET", path, headers={**headers, "Accept": "text/event-stream"}) as r:
            self.statuses.append(r.status_code)
            self.opened.release()
            for _ in r.iter_lines():
                if self.stop.is_set():
                    return

    def close(self):
        self.stop.set()


def test_the_streams_of_a_job_share_one_follower(tmp_path):
    bed = make_testbed(tmp_path, sse_poll_s=0.05, sse_heartbeat_s=0.2)
    counting = Counting(bed.client)
    try:
        with running_server(create_app(counting, bed.settings)) as url:
            job = httpx.post(f"{url}/finetune", json=bed.spec(max_steps=10), headers=bed.auth("acme")).json()
            bed.agent(job["node_id"]).hold(job["id"])  # no more events: the streams only wait
            path = f"/finetune/{job['id']}/events"
            rates = {}
            for n in (1, 40):
                streams = Streams(url, path, bed.auth("acme"), n)
                time.sleep(0.5)
                before = counting.polls()
                time.sleep(2.0)
                rates[n] = (counting.polls() - before) / 2.0
                streams.close()
                assert streams.statuses == [200] * n
                time.sleep(1.5)  # the heartbeats end the closed streams, and their follower with them
            print(f"coordinator calls a second: 1 stream {rates[1]:.0f}, 40 streams {rates[40]:.0f}")
            assert rates[1] > 0
            assert rates[40] < 2 * rates[1] + 5, rates  # one follower for the job, not one poll per stream
    finally:
        bed.close()


def test_a_tenants_streams_are_capped_and_the_others_are_not(tmp_path):
    bed = make_testbed(tmp_path, sse_poll_s=0.05, sse_heartbeat_s=0.2, max_streams_per_tenant=3)
    try:
        with running_server(create_app(bed.client, bed.settings)) as url:
            jobs = {t: httpx.post(f"{url}/finetune", json=bed.spec(max_steps=10), headers=bed.auth(t)).json()
                    for t in ("acme", "globex")}
            for job in jobs.values():
                bed.agent(job["node_id"]).hold(job["id"])
            acme = Streams(url, f"/finetune/{jobs['acme']['id']}/events", bed.auth("acme"), 3)
            sse = {"Accept": "text/event-stream"}
            r = httpx.get(f"{url}/finetune/{jobs['acme']['id']}/events", headers={**bed.auth("acme"), **sse})
            assert r.status_code == 429 and r.headers["retry-after"] == "5", r.text
            assert r.json()["error"]["code"] == "too_many_streams" and "max_streams_per_tenant" in r.text
            globex = Streams(url, f"/finetune/{jobs['globex']['id']}/events", bed.auth("globex"), 1)
            assert globex.statuses == [200]
            acme.close()
            globex.close()

            def reopened():
                with httpx.stream("GET", f"{url}/finetune/{jobs['acme']['id']}/events",
                                  headers={**bed.auth("acme"), **sse}) as r:
                    return r.status_code == 200

            deadline = time.monotonic() + 20
            while not reopened():  # a closed stream gives its slot back
                assert time.monotonic() < deadline, "the closed streams never gave their slots back"
                time.sleep(0.2)
    finally:
        bed.close()


def test_a_tenants_request_rate_is_limited_and_the_others_is_not(tmp_path):
    bed = make_testbed(tmp_path, rate_limit_per_s=2.0, rate_limit_burst=5)
    try:
        with running_server(create_app(bed.client, bed.settings)) as url, httpx.Client(base_url=url) as http:
            # until the first refusal: the burst of 5, plus what the bucket refilled (2 a second) meanwhile, on a
            # box however slow
            t0, codes = time.monotonic(), []
            while 429 not in codes and len(codes) < 200:
                r = http.get("/finetune", headers=bed.auth("acme"))
                codes.append(r.status_code)
            elapsed = time.monotonic() - t0
            assert codes[-1] == 429 and 5 <= codes.index(429) <= 5 + 2.0 * elapsed + 1, (codes, elapsed)
            assert int(r.headers["retry-after"]) == 1 and "rate_limit_per_s" in r.text
            assert http.get("/finetune", headers=bed.auth("globex")).status_code == 200
            assert http.get("/healthz").status_code == 200  # open routes are no tenant's
            time.sleep(1.1)
            assert http.get("/finetune", headers=bed.auth("acme")).status_code == 200  # the bucket refills
    finally:
        bed.close()


def lines(n: int, text: str = "x") -> bytes:
    return b"".join(json.dumps({"text": f"{text} {i}"}).encode() + b"\n" for i in range(n))


def test_upload_count_bytes_and_in_flight_quotas(tmp_path):
    bed = make_testbed(tmp_path, max_files_per_tenant=2, max_file_bytes_per_tenant=4000, max_uploads_in_flight=1)
    try:
        with running_server(create_app(bed.client, bed.settings)) as url, httpx.Client(base_url=url) as http:
            sent, release = threading.Event(), threading.Event()

            def slow_body():
                yield lines(5)
                sent.set()
                release.wait(30)
                yield lines(5, "y")

            first: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: first.append(
                httpx.post(f"{url}/files", content=slow_body(), headers=bed.auth("acme"), timeout=60)))
            sender.start()
            assert sent.wait(20)
            deadline = time.monotonic() + 20
            # the route holds the tenant's one upload slot once its part file exists (a condition, not a sleep)
            while not list(bed.settings.files_dir("acme").glob(".file-*.part")):
                assert time.monotonic() < deadline, "the first upload never reached the route"
                time.sleep(0.02)
            r = http.post("/files", content=lines(3), headers=bed.auth("acme"))  # a second upload meanwhile
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "too_many_uploads" and r.headers["retry-after"]
            assert "max_uploads_in_flight" in r.text
            assert http.post("/files", content=lines(3), headers=bed.auth("globex")).status_code == 201
            release.set()
            sender.join(60)
            assert first[0].status_code == 201, first[0].text

            assert http.post("/files", content=lines(3), headers=bed.auth("acme")).status_code == 201
            r = http.post("/files", content=lines(3), headers=bed.auth("acme"))  # a third file
            assert r.status_code == 429 and "max_files_per_tenant" in r.text and r.headers["retry-after"]
            kept = http.get("/files", headers=bed.auth("acme")).json()["data"]
            assert len(kept) == 2
            http.delete(f"/files/{kept[0]['id']}", headers=bed.auth("acme"))
            r = http.post("/files", content=lines(400), headers=bed.auth("acme"))  # past 4000 bytes kept
            assert r.status_code == 429 and "max_file_bytes_per_tenant" in r.text, r.text
            assert len(http.get("/files", headers=bed.auth("acme")).json()["data"]) == 1
            assert not list(bed.settings.files_dir("acme").glob(".*.part"))  # nothing half-written is left
    finally:
        bed.close()


# The API in a fresh process (a test process's heap would hide growth): a testbed, served on a free port.
SERVER = textwrap.dedent("""
    import sys
    from api.app import create_app
    from api.server import running_server
    from api.testing import make_testbed
    bed = make_testbed(sys.argv[1], max_upload_bytes=1 << 30)
    with running_server(create_app(bed.client, bed.settings)) as url:
        print(url, flush=True)
        sys.stdin.read()  # until the test closes it
""")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_an_upload_costs_a_few_mib_whatever_its_size(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://"), url
        headers = {"Authorization": "Bearer key-acme"}
        example = json.dumps({"instruction": "add 12 and 30 " + "pad " * 40, "output": "42"}).encode() + b"\n"

        def body(total: int):
            chunk = example * (256 * 1024 // len(example))
            for _ in range(total // len(chunk)):
                yield chunk

        with httpx.Client(base_url=url, timeout=300) as http:
            warm = http.post("/files", content=body(4 << 20), headers=headers)  # every import and buffer in place
            assert warm.status_code == 201, warm.text
            before = peak_rss(server.pid)
            big = http.post("/files", content=body(96 << 20), headers=headers)
            assert big.status_code == 201, big.text
            grew = peak_rss(server.pid) - before
        assert big.json()["num_examples"] > 400_000 and big.json()["bytes"] > 90 << 20
        print(f"a 96 MiB upload grew the API's peak RSS by {grew / 2**20:.1f} MiB")
        assert grew < 16 << 20, f"the API grew by {grew / 2**20:.0f} MiB for a 96 MiB upload"
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            psutil.Process(server.pid).kill()
            server.wait()
