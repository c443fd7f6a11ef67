"""One node whose agent answers every call after `--delay` seconds: the API's `GET /finetune` and
`POST /finetune` latency while the coordinator polls it.

    python benchmarks/slow_node.py --out benchmarks/service/slow-node.json

What runs: a local Ray cluster of two simulated nodes, `fast` and `slow`, the coordinator actor (the service's
real one), a node agent on each (the slow one is the real `RayNodeAgent` with a sleep before each call), and
the API in its own process (`uvicorn --factory api.app:app_from_env`, as deployed), talking to the coordinator
over Ray. The tenant submits a job (the engines are the stand-in of `noisy_tenant.py`: one metrics line a
second, no training), lists its jobs `--samples` times, then submits `--submits` jobs.

Before this change a coordinator pass asked the agents one after the other under the coordinator's lock and a
submit ran a whole pass in an actor that took one call at a time: every call waited for the slow node. The
script uses only what both versions have, so a before/after runs it on another checkout:
`cd OLD && PYTHONPATH=$PWD python NEW/benchmarks/slow_node.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from noisy_tenant import free_port, percentiles  # noqa: E402  (the stand-in engine and the statistics)


def slow_agent_class(delay_s: float):
    import ray

    from horizon_ray.cluster.ray_actors import RayNodeAgent

    class SlowNodeAgent(RayNodeAgent):
        """The real agent, each answer `delay_s` late (a node under load, or far away)."""

        def info(self):
            time.sleep(delay_s)
            return super().info()

        def poll(self, offsets):
            time.sleep(delay_s)
            return super().poll(offsets)

    return ray.remote(SlowNodeAgent)


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import httpx
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import horizon_ray
    from horizon_ray.cluster.client import NAMESPACE
    from horizon_ray.cluster.local import SimulatedNode, start_simulated_cluster, stop_service  # old checkouts too
    from horizon_ray.cluster.ray_actors import AGENT_PREFIX, ensure_agents, node_name_of, start_coordinator
    from horizon_ray.job.demo import prepare_demo_assets

    work = Path(tempfile.mkdtemp(prefix="slow-node-"))
    demo, _ = prepare_demo_assets(work / "assets")
    nodes = {"fast": SimulatedNode(ram_bytes=64 * 2**30, cpu_count=1),
             "slow": SimulatedNode(ram_bytes=64 * 2**30, cpu_count=1)}
    engine = [sys.executable, str(HERE / "noisy_tenant.py"), "--engine"]
    cluster = start_simulated_cluster(nodes)
    api = None
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        ensure_agents({"fast": nodes["fast"]}, command=engine, only_simulated=True)
        slow_node = next(n for n in ray.nodes() if n.get("Alive") and node_name_of(n) == "slow")
        slow = slow_agent_class(args.delay).options(
            name=AGENT_PREFIX + "slow", namespace=NAMESPACE, lifetime="detached", num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(slow_node["NodeID"], soft=False),
        ).remote("slow", ram_bytes=nodes["slow"].ram_bytes, gpu_count=0, cpu_count=1, command=engine)
        ray.get(slow.ping.remote(), timeout=120)
        coordinator = start_coordinator(work / "coordinator.sqlite", work / "jobs")
        ray.get(coordinator.tick.remote(), timeout=120)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "HORIZON_API_KEYS": "key-acme=acme", "HORIZON_RAY_ADDRESS": cluster.address,
               "HORIZON_JOBS_ROOT": str(work / "jobs"), "HORIZON_MODEL_ROOTS": str(demo.model_dir.parent),
               "HORIZON_DATA_ROOTS": str(demo.model_dir.parent), "HORIZON_UPLOADS_DIR": str(work / "uploads"),
               "HORIZON_API_RATE_LIMIT_PER_S": "1000", "HORIZON_API_RATE_LIMIT_BURST": "1000"}
        api = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:app_from_env", "--port",
                                str(port), "--log-level", "warning"], env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=open(work / "api.log", "wb"))
        auth = {"Authorization": "Bearer key-acme"}
        spec = {"model": {"path": "model"}, "data": {"path": "train.jsonl", "format": "messages"},
                "training": {"max_steps": 1000}, "engine": {"device": "cpu"}}
        with httpx.Client(base_url=url, timeout=120) as http:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if http.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or api.poll() is not None:
                    raise RuntimeError("the API did not come up")
                time.sleep(0.5)
            http.post("/finetune", json=spec, headers=auth).raise_for_status()  # a job to list (and report)
            lists = []
            for _ in range(args.samples):
                t0 = time.perf_counter()
                http.get("/finetune", headers=auth).raise_for_status()
                lists.append(time.perf_counter() - t0)
                time.sleep(args.gap)
            submits = []
            for _ in range(args.submits):
                t0 = time.perf_counter()
                http.post("/finetune", json=spec, headers=auth).raise_for_status()
                submits.append(time.perf_counter() - t0)
        return {"agent_delay_s": args.delay, "code": str(Path(horizon_ray.__file__).parents[1]),
                "cpus": os.cpu_count(), "list": percentiles(lists), "submit": percentiles(submits)}
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=4.0, help="seconds the slow agent takes for each answer")
    parser.add_argument("--samples", type=int, default=100, help="GET /finetune requests")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between two of them")
    parser.add_argument("--submits", type=int, default=5, help="POST /finetune requests after the lists")
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
