"""One noisy tenant against a quiet one: the quiet tenant's `GET /finetune` latency with the noisy tenant's
event streams open.

    python benchmarks/noisy_tenant.py --streams 500 --out benchmarks/results/noisy-tenant.json

What runs: a local Ray cluster of one simulated node, the node agent and the coordinator (the service's real
actors), and the API in its own process (`uvicorn --factory api.app:app_from_env`, as deployed), talking to
the coordinator over Ray. The noisy tenant submits `--jobs` jobs and opens `--streams` SSE streams spread over
them; the quiet tenant submits one job and lists its jobs `--samples` times, one request every `--gap`
seconds, first with no stream open, then with all of them. The engines are a stand-in (this file, run as the
agents' engine command): a process that reports one metrics line a second and no training, so that the CPU
measures the service, not the model.

The API gets `HORIZON_API_MAX_STREAMS_PER_TENANT` = `--streams` and a request rate that lets the noisy tenant
open its streams (the defaults would refuse most of them with 429: that is the limit doing its job, not what
is measured here). Against an older API these variables are ignored; the script uses only what both have, so
a before/after runs it on another checkout: `cd OLD && PYTHONPATH=$PWD python NEW/benchmarks/noisy_tenant.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TENANTS = "tenants:\n  noisy: {max_concurrent_jobs: 1000}\n  quiet: {max_concurrent_jobs: 10}\n"


def stand_in_engine(argv: list[str]) -> int:
    """`noisy_tenant.py --engine --config SPEC --resume`: one metrics line a second until SIGTERM."""
    import yaml

    from horizon_ray.job import events as ev
    from horizon_ray.job.metrics import METRICS_FILE

    spec = yaml.safe_load(open(argv[argv.index("--config") + 1]))
    out = Path(spec["output_dir"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(out / METRICS_FILE, "a") as f:
        f.write(ev.encode(ev.Start(step=0, total_steps=1_000_000)))
        f.flush()
        for step in range(1, 1_000_000):
            time.sleep(1.0)
            f.write(ev.encode(ev.Metrics(step=step, loss=1.0 / step, total_steps=1_000_000)))
            f.flush()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_ms": round(statistics.median(samples) * 1e3, 1), "p99_ms": round(q[98] * 1e3, 1),
            "max_ms": round(max(samples) * 1e3, 1), "n": len(samples)}


def measure(http, url: str, headers: dict, samples: int, gap: float) -> dict:
    times, errors = [], 0
    for _ in range(samples):
        t0 = time.perf_counter()
        r = http.get(f"{url}/finetune", headers=headers)
        times.append(time.perf_counter() - t0)
        errors += r.status_code != 200
        time.sleep(gap)
    return {**percentiles(times), "errors": errors}


class StreamLoad:
    """`paths` SSE streams held open on an asyncio loop of their own thread."""

    def __init__(self, url: str, headers: dict, paths: list[str], open_per_s: float):
        self.url, self.headers, self.paths, self.open_per_s = url, headers, paths, open_per_s
        self.statuses: dict[int, int] = {}
        self.events = 0
        self.open = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        import httpx

        self.stop = asyncio.Event()
        limits = httpx.Limits(max_connections=len(self.paths) + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits) as http:
            tasks = []
            for path in self.paths:
                tasks.append(asyncio.create_task(self._stream(http, path)))
                await asyncio.sleep(1.0 / self.open_per_s)
            await asyncio.sleep(2.0)
            self.ready.set()
            await self.stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(self, http, path: str) -> None:
        headers = {**self.headers, "Accept": "text/event-stream"}
        async with http.stream("GET", path, headers=headers) as r:
            self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                return
            self.open += 1
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    self.events += 1

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=60)


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import httpx
    import ray

    import horizon_ray
    from horizon_ray.cluster.client import NAMESPACE
    from horizon_ray.cluster.local import SimulatedNode, start_simulated_cluster, stop_service
    from horizon_ray.cluster.ray_actors import ensure_agents, start_coordinator
    from horizon_ray.job.demo import prepare_demo_assets

    work = Path(tempfile.mkdtemp(prefix="noisy-tenant-"))
    demo, _ = prepare_demo_assets(work / "assets")
    (work / "tenants.yaml").write_text(TENANTS)
    nodes = {"a": SimulatedNode(ram_bytes=256 * 2**30, cpu_count=1)}
    cluster = start_simulated_cluster(nodes)
    api = None
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        ensure_agents(nodes, command=[sys.executable, str(Path(__file__).resolve()), "--engine"], only_simulated=True)
        coordinator = start_coordinator(work / "coordinator.sqlite", work / "jobs",
                                        tenants_file=str(work / "tenants.yaml"))
        ray.get(coordinator.tick.remote(), timeout=120)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "HORIZON_API_KEYS": "key-noisy=noisy,key-quiet=quiet",
               "HORIZON_RAY_ADDRESS": cluster.address, "HORIZON_JOBS_ROOT": str(work / "jobs"),
               "HORIZON_MODEL_ROOTS": str(demo.model_dir.parent), "HORIZON_DATA_ROOTS": str(demo.model_dir.parent),
               "HORIZON_UPLOADS_DIR": str(work / "uploads")}
        if not args.default_limits:
            env.update({"HORIZON_API_MAX_STREAMS_PER_TENANT": str(args.streams),
                        "HORIZON_API_RATE_LIMIT_PER_S": str(max(20, args.open_per_s * 2)),
                        "HORIZON_API_RATE_LIMIT_BURST": str(max(100, args.streams))})
        api = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:app_from_env", "--port",
                                str(port), "--log-level", "warning"], env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=open(work / "api.log", "wb"))
        noisy, quiet = {"Authorization": "Bearer key-noisy"}, {"Authorization": "Bearer key-quiet"}
        spec = {"model": {"path": "model"}, "data": {"path": "train.jsonl", "format": "messages"},
                "training": {"max_steps": 1000}, "engine": {"device": "cpu"}}
        with httpx.Client(timeout=120) as http:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if http.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or api.poll() is not None:
                    raise RuntimeError("the API did not come up")
                time.sleep(0.5)
            jobs = []
            for _ in range(args.jobs):
                r = http.post(f"{url}/finetune", json=spec, headers=noisy)
                r.raise_for_status()
                jobs.append(r.json()["id"])
            http.post(f"{url}/finetune", json=spec, headers=quiet).raise_for_status()
            time.sleep(3)
            idle = measure(http, url, quiet, args.samples, args.gap)
            paths = [f"/finetune/{jobs[i % len(jobs)]}/events" for i in range(args.streams)]
            load = StreamLoad(url, noisy, paths, args.open_per_s)
            if not load.ready.wait(args.streams / args.open_per_s + 120):
                raise RuntimeError("the streams did not open")
            loaded = measure(http, url, quiet, args.samples, args.gap)
            streams_open, statuses, events = load.open, dict(load.statuses), load.events
            load.close()
        return {"streams_asked": args.streams, "streams_open": streams_open, "stream_statuses": statuses,
                "events_received": events, "noisy_jobs": args.jobs, "default_limits": args.default_limits,
                "code": str(Path(horizon_ray.__file__).parents[1]), "cpus": os.cpu_count(),
                "quiet_list_no_streams": idle, "quiet_list_with_streams": loaded}
    finally:
        if api is not None:
            os.killpg(api.pid, signal.SIGTERM)
            try:
                api.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(api.pid, signal.SIGKILL)
        try:
            stop_service()
        finally:
            ray.shutdown()
            cluster.shutdown()


def main() -> int:
    if "--engine" in sys.argv:
        return stand_in_engine(sys.argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=500, help="SSE streams the noisy tenant opens")
    parser.add_argument("--jobs", type=int, default=10, help="jobs of the noisy tenant the streams spread over")
    parser.add_argument("--samples", type=int, default=200, help="GET /finetune requests of the quiet tenant")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between two of them")
    parser.add_argument("--open-per-s", type=float, default=50.0, help="streams opened a second")
    parser.add_argument("--default-limits", action="store_true",
                        help="leave the API's stream cap and request rate at their defaults (most streams are refused)")
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
