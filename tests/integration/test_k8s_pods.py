"""The KubeRay deployment of k8s/ run as local processes, without a cluster (tests/podsim.py).

Each overlay is rendered with `kubectl kustomize` (the test's own renderer of tests/unit/test_k8s.py, checked
against kubectl there, where kubectl is missing). The head pod (its ray-head and horizon-control
containers), one worker pod and one API pod then start with exactly the commands, arguments and environment
of the manifests, as KubeRay v1.7 completes them for the Ray containers; downward-API values come from the
declared requests and limits, Secrets from what an operator and KubeRay would create. Every pod has its own
network namespace and address, every container its own mount and PID namespaces holding only the volumes
its pod spec mounts, and runs as the pod's user. Through that deployment:

- the API becomes ready (it is started before the head: it connects when the head is up);
- only the worker runs a node agent, which offers the pod's memory less Ray's share;
- a job submitted over REST trains on the worker and writes its model on the shared volume; on the
  whole-node overlay a job whose REST body asks for 2 GPUs (resources.gpus) runs as two ranks of the one pod;
- the RayJob example's entrypoint runs through the token-protected job server: as shipped it asks for the
  7B job, which the coordinator turns down on the dev overlay's small worker, naming why; with the spec the
  example names for the dev overlay it trains on the worker;
- the worker pod is deleted while a job trains: its preStop hook checkpoints the job at its step, and the
  job resumes from that step on the pod that replaces it;
- the head dies and comes back: the API reconnects, the job table survives, the worker rejoins;
- no Ray port of any pod answers a request without Ray's token;
- no container's processes use more memory than its limit;
- nothing is left running afterwards.

A tiny model stands in for the models the job specs name (there are no Qwen weights here): the loader step
copies the demo's model under those names, as an operator copies real ones (k8s/README.md, step 4).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import podsim

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
TENANT = "team-a"
GiB = 1 << 30

# What the API answers at once, and what a job may take: bounded waits, each with the reason in its message.
READY_S = 300  # the pods start, Ray comes up on a loaded 2-core machine, the coordinator loads
JOB_S = 300
TRAINING_S = 900  # a RayJob that keeps training (wait_done_while_it_trains)

# The public shape of Qwen2.5-7B-Instruct (its config.json, no weights): what the coordinator plans from.
QWEN_7B_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                  "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                  "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                  "hidden_act": "silu", "torch_dtype": "bfloat16"}


def rendered(variant: str) -> list[dict[str, Any]]:
    """The variant's resources as `kubectl apply -k` would create them, and the examples."""
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(K8S / variant)], capture_output=True, text=True,
                             check=True, timeout=120).stdout
        docs = [d for d in yaml.safe_load_all(out) if d]
    else:  # the renderer tests/unit/test_k8s.py checks against kubectl wherever kubectl is installed
        from tests.unit.test_k8s import render

        docs = render(K8S / variant)
    for path in sorted((K8S / "examples").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def pods_allowed() -> None:
    why = podsim.unavailable()
    if why:
        pytest.skip(f"pods cannot be simulated here: {why}")


@dataclass
class Deployment:
    sim: podsim.Simulation
    variant: str
    api_key: str
    ray_token: str
    api_url: str
    head: str  # pod names
    worker: str
    api: str
    shared: Path  # the shared volume's folder on this machine
    worker_group: dict[str, Any]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def get(self, path: str, **kw: Any) -> Any:
        import httpx

        return httpx.get(self.api_url + path, headers=self.headers(), timeout=30, **kw)

    def post(self, path: str, body: Any) -> Any:
        import httpx

        return httpx.post(self.api_url + path, headers=self.headers(), json=body, timeout=60)

    def wait(self, what: str, predicate, timeout_s: float, interval_s: float = 1.0, job_id: str | None = None) -> Any:
        """`predicate()` once it is true; on a timeout, an AssertionError with every container's log and, for
        `job_id`, the job's story (`story`). A wait on a job gives up at once when the job has ended and the
        predicate still is not true: nothing it waits for can come any more. "Still": the predicate is asked once
        more after the job is seen ended, since the job may end between the two reads (a wait for the job's end
        failed so in CI, the predicate having read it running and the check then read it succeeded)."""
        def ask() -> Any:
            try:
                return predicate()
            except Exception as exc:  # noqa: BLE001 - keep waiting; the last error goes in the message
                return exc

        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            last = ask()
            if last and not isinstance(last, Exception):
                return last
            ended = self._ended(job_id)
            if ended is not None:
                last = ask()
                if last and not isinstance(last, Exception):
                    return last
                raise AssertionError(f"job {job_id} ended {ended} while waiting for {what} (last: {last!r})\n"
                                     + self.story(job_id) + self.sim.dump())
            time.sleep(interval_s)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})\n"
                             + (self.story(job_id) if job_id else self.coordinator_log()) + self.sim.dump())

    def _ended(self, job_id: str | None) -> str | None:
        """The status of ``job_id`` when it is terminal; None while it lives, or when it cannot be read now."""
        if job_id is None:
            return None
        try:
            status = self.get(f"/finetune/{job_id}").json()["status"]
        except Exception:  # noqa: BLE001 - the API may be restarting; the wait goes on
            return None
        return status if status in ("succeeded", "failed", "cancelled") else None

    def coordinator_log(self, chars: int = 12000) -> str:
        """The tail of the coordinator's log (on the state volume; horizon-control prints it too)."""
        path = self.sim.claim_dir("horizon-ray-state") / "coordinator.log"
        try:
            text = path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            text = f"(unreadable: {exc})\n"
        return f"==== coordinator log {path} (tail) ====\n{text}\n"

    def story(self, job_id: str) -> str:
        """What the service says of a job: its record, its status events, its engines' logs, the coordinator's
        log."""
        out = []
        try:
            job = self.get(f"/finetune/{job_id}").json()
            out.append(f"==== job {job_id} ====\n" + json.dumps(
                {k: job.get(k) for k in ("status", "node_id", "attempts", "queue", "error", "progress",
                                         "last_checkpoint_step")}, indent=1))
            events, after = [], 0
            for _ in range(50):
                page = self.get(f"/finetune/{job_id}/events", params={"after": after, "limit": 1000}).json()
                events += [e for e in page["data"] if e["type"] in ("status", "error", "checkpoint")]
                after = page["last_seq"]
                if not page["has_more"]:
                    break
            out.append("==== its status, error and checkpoint events ====\n" + "\n".join(
                f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['type']} {json.dumps(e['data'])[:400]}"
                for e in events))
        except Exception as exc:  # noqa: BLE001 - the API may be what failed
            out.append(f"==== job {job_id}: the API did not say ({exc!r}) ====")
        for log in sorted((self.shared / "jobs" / TENANT / job_id / "logs").glob("*.log")):
            out.append(f"==== engine log {log.name} (tail) ====\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(out) + "\n" + self.coordinator_log()

    def ready(self) -> bool:
        import httpx

        try:
            return httpx.get(self.api_url + "/readyz", timeout=15).status_code == 200
        except httpx.HTTPError:
            return False


def load_the_shared_volume(shared: Path) -> None:
    """What k8s/examples/loader-pod.yaml is for: base models under models/, datasets under datasets/."""
    from horizon_ray.job.demo import prepare_demo_assets

    demo, _ = prepare_demo_assets(shared.parent / "demo-home")
    models, data = shared / "models", shared / "datasets" / "chat"
    data.mkdir(parents=True)
    lines = demo.train_path.read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:240]))
    shutil.copytree(demo.model_dir, models / "tiny-demo")
    # stand-ins for the models the job specs of k8s/ name (there are no Qwen weights on this machine)
    shutil.copytree(demo.model_dir, models / "Qwen2.5-0.5B-Instruct")
    (models / "Qwen2.5-7B-Instruct").mkdir()
    (models / "Qwen2.5-7B-Instruct" / "config.json").write_text(json.dumps(QWEN_7B_CONFIG))
    subprocess.run(["chown", "-R", "1000:1000", str(models), str(shared / "datasets")], check=True)


@contextlib.contextmanager
def deployment(variant: str) -> Iterator[Deployment]:
    docs = rendered(variant)
    # short: Ray's socket paths must fit
    workdir = Path(tempfile.mkdtemp(prefix="hrk-", dir="/tmp"))
    sim = podsim.Simulation(workdir, docs)
    leftovers: list[int] = []
    try:
        # the operator: the API keys Secret (k8s/README.md, step 2); KubeRay: the token of authOptions
        api_key, token = secrets.token_urlsafe(24), secrets.token_hex(32)
        sim.create_secret("horizon-ray-api-keys", {"api-keys.yaml": yaml.safe_dump({"keys": {api_key: TENANT}})})
        cluster = sim.doc("RayCluster")
        sim.create_secret(cluster["metadata"]["name"], {"auth_token": token})
        shared = sim.claim_dir("horizon-ray-shared")
        load_the_shared_volume(shared)

        group = next(g for g in cluster["spec"]["workerGroupSpecs"] if g.get("replicas", 0) > 0)
        name = cluster["metadata"]["name"]
        api = sim.add_pod("horizon-ray-api-5f7d8c9b6-x2k4q", sim.doc("Deployment", "horizon-ray-api")["spec"][
            "template"], 30, service="horizon-ray-api")
        head = sim.add_pod(f"{name}-head-7fxqd", podsim.kuberay_pod(cluster, None), 10,
                           service=podsim.head_service(cluster))
        worker = sim.add_pod(f"{name}-{group['groupName']}-worker-m4c2z", podsim.kuberay_pod(cluster, group), 20)
        sim.start(api.name, head.name, worker.name)  # the API first: it must wait for the head by itself
        url = f"http://127.0.0.1:{sim.port_forward(api.name, 8000)}"
        yield Deployment(sim=sim, variant=variant, api_key=api_key, ray_token=token, api_url=url, head=head.name,
                         worker=worker.name, api=api.name, shared=shared, worker_group=group)
    finally:
        leftovers = sim.close()
        if os.environ.get("HORIZON_PODSIM_KEEP"):  # logs, volumes and containers' layers, for a post-mortem
            print(f"podsim: kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    assert not leftovers, f"processes outlived the simulated pods (killed now): {leftovers}"


# ---- checks ------------------------------------------------------------------------------------------------


def check_only_the_worker_runs_an_agent(d: Deployment) -> dict[str, Any]:
    from horizon_ray.cluster.agent import RAY_PROCESSES_BYTES

    # serve starts agents on the nodes there are when it starts (the head is one), then on nodes that join
    # (the worker): once the worker's agent shows, a head agent would have too
    nodes = d.wait("the worker's agent in /nodes", lambda: alive_nodes(d), 120)
    assert len(nodes) == 1, f"one node agent (the worker's) expected, the head runs none: {nodes}"
    node = nodes[0]
    limits = d.worker_group["template"]["spec"]["containers"][0]["resources"]["limits"]
    store = podsim.quantity(d.worker_group["rayStartParams"]["object-store-memory"])
    assert node["ram_bytes"] == podsim.quantity(limits["memory"]) - store - RAY_PROCESSES_BYTES, node
    return node


def alive_nodes(d: Deployment) -> list[dict[str, Any]]:
    return [n for n in d.get("/nodes").json()["data"] if n["alive"]]


def submit_rest_job(d: Deployment, name: str, max_steps: int = 3, checkpoint_every: int = 100,
                    gpus: int = 1) -> dict[str, Any]:
    body = {"name": name, "model": {"path": "tiny-demo"},
            "data": {"path": "chat/train.jsonl", "format": "messages", "eval_fraction": 0.0},
            "training": {"max_steps": max_steps, "micro_batch_size": 2, "seq_len": 64,
                         "schedule": {"type": "constant"}},
            "checkpoint": {"every_steps": checkpoint_every, "keep": 1}, "engine": {"device": "cpu"}}
    if gpus != 1:
        body["resources"] = {"gpus": gpus}  # ranks of one node; on a node without GPUs they run on the CPU
    r = d.post("/finetune", body)
    assert r.status_code in (200, 201, 202), r.text
    return r.json()


def wait_job(d: Deployment, job_id: str) -> dict[str, Any]:
    def ended():
        job = d.get(f"/finetune/{job_id}").json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    job = d.wait(f"job {job_id} to end", ended, JOB_S, interval_s=2.0, job_id=job_id)
    assert job["status"] == "succeeded", d.story(job_id) + d.sim.dump()
    return job


PROBE = r"""
import http.client, json, sys
import grpc
targets, token = json.loads(sys.argv[1]), sys.argv[2]
bearer = "Bearer " + token
# a read-only method of each of Ray's gRPC services (called with the token too), then one called without only
READ_ONLY = ["/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetSystemConfig",
             "/ray.rpc.CoreWorkerService/NumPendingTasks", "/ray.rpc.RayletDriver/ClusterInfo",
             "/ray.rpc.ReporterService/HealthCheck", "/ray.rpc.LogService/ListLogs"]
WITHOUT_TOKEN_ONLY = ["/ray.rpc.ObjectManagerService/Pull"]

def http_call(ip, port, method, path, headers):
    c = http.client.HTTPConnection(ip, port, timeout=10)
    c.request(method, path, body=b"{}" if method == "POST" else None,
              headers={"Content-Type": "application/json", **headers})
    r = c.getresponse()
    out = (r.status, r.read(200).decode("utf-8", "replace"))
    c.close()
    return out

def grpc_call(channel, method, metadata):
    try:
        channel.unary_unary(method, request_serializer=None, response_deserializer=None)(
            b"", timeout=10, metadata=metadata)
        return "OK"
    except grpc.RpcError as err:
        return err.code().name

out = []
for ip, port in targets:
    entry = {"ip": ip, "port": port}
    try:
        entry["kind"] = "http"
        entry["post_anonymous"] = http_call(ip, port, "POST", "/api/jobs/", {})[0]
        entry["get_anonymous"] = http_call(ip, port, "GET", "/api/jobs/", {})
        entry["get_token"] = http_call(ip, port, "GET", "/api/jobs/", {"Authorization": bearer})[0]
    except (http.client.HTTPException, OSError):  # not HTTP/1.1: gRPC
        entry = {"ip": ip, "port": port, "kind": "grpc"}
        channel = grpc.insecure_channel("%s:%d" % (ip, port))
        for method in READ_ONLY + WITHOUT_TOKEN_ONLY:
            code = grpc_call(channel, method, ())
            if code != "UNIMPLEMENTED":
                entry["method"], entry["anonymous"] = method, code
                if method in READ_ONLY:
                    entry["token"] = grpc_call(channel, method, (("authorization", bearer),))
                break
        channel.close()
    out.append(entry)
print(json.dumps(out))
"""


def check_no_ray_port_answers_without_the_token(d: Deployment) -> list[dict[str, Any]]:
    """From elsewhere in the cluster's network, every port the Ray pods listen on (not loopback): a request
    without Ray's token is refused; with it, it is not. Ray's Prometheus endpoints are the exception (Ray
    does not authenticate them): they serve only metrics, whatever the request."""
    targets = [[d.sim.pods[p].address, port] for p in (d.head, d.worker) for port in d.sim.listening(p)]
    out = d.sim.in_cluster([sys.executable, "-c", PROBE, json.dumps(targets), d.ray_token], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout)
    problems, metrics_only = [], []
    for r in results:
        where = f"{r['ip']}:{r['port']}"
        if r["kind"] == "grpc":
            if "method" not in r:
                problems.append(f"{where}: a gRPC server none of whose methods the probe knows")
            elif r["anonymous"] != "UNAUTHENTICATED":
                problems.append(f"{where}: {r['method']} without the token: {r['anonymous']}")
            elif r.get("token") == "UNAUTHENTICATED":
                problems.append(f"{where}: {r['method']} refused the token")
            continue
        status, body = r["get_anonymous"]
        if 200 <= r["post_anonymous"] < 300:
            problems.append(f"{where}: POST /api/jobs/ without the token: {r['post_anonymous']}")
        if status in (401, 403):
            if r["get_token"] in (401, 403):
                problems.append(f"{where}: refused the token")
        elif body.startswith("# HELP") or body.startswith("# TYPE"):
            metrics_only.append(where)
        else:
            problems.append(f"{where}: GET /api/jobs/ without the token: {status} {body[:80]!r}")
    assert not problems, "Ray ports that answer without the token:\n" + "\n".join(problems)
    grpc_ports = {r["port"] for r in results if r["kind"] == "grpc"}
    assert 6379 in grpc_ports and 10001 in grpc_ports, results  # the GCS and the Ray Client server
    dashboard = next(r for r in results if r["port"] == 8265)
    assert dashboard["get_anonymous"][0] == 401 and dashboard["get_token"] == 200, dashboard
    print(f"Ray ports probed: {len(results)}; refused without the token: {len(results) - len(metrics_only)}; "
          f"Prometheus metrics only (not authenticated by Ray): {', '.join(metrics_only)}")
    return results


def run_rayjob(d: Deployment, job: dict[str, Any], submission_id: str, address_suffix: int) -> podsim.Pod:
    # applied as the example's header says: `TEAM_A_KEY=<key> envsubst '$TEAM_A_KEY' < rayjob-finetune.yaml`
    job = copy.deepcopy(job)
    assert "${TEAM_A_KEY}" in job["spec"]["runtimeEnvYAML"], "the RayJob declares its tenant by a key"
    job["spec"]["runtimeEnvYAML"] = job["spec"]["runtimeEnvYAML"].replace("${TEAM_A_KEY}", d.api_key)
    cluster = d.sim.doc("RayCluster")
    pod = d.sim.add_pod(f"{submission_id}-submitter", podsim.kuberay_submitter_pod(job, cluster, submission_id),
                        address_suffix)
    d.sim.start(pod.name)
    wait_done_while_it_trains(pod, JOB_S, TRAINING_S)
    return pod


def wait_done_while_it_trains(pod: podsim.Pod, stall_s: float, total_s: float) -> str:
    """A submitter pod's phase once it has exited. It may take as long as its job keeps training, up to
    ``total_s``: the wait gives up after ``stall_s`` without a new "step N/M" line in the pod's log. A fixed
    deadline failed CI on a loaded machine, where the dev spec's 200 steps took over 7 minutes (about 4
    unloaded). The tests that wait so carry a pytest timeout above their waits' sum (pytest-timeout's thread
    method ends the whole run)."""
    seen, deadline = "", time.monotonic() + stall_s
    end = time.monotonic() + total_s
    while pod.phase in ("Pending", "Running") and time.monotonic() < min(deadline, end):
        steps = re.findall(r"\bstep (\d+/\d+)", pod.containers[0].tail(4000))
        if steps and steps[-1] != seen:
            seen, deadline = steps[-1], time.monotonic() + stall_s
        time.sleep(0.5)
    return pod.phase


def check_memory_within_limits(d: Deployment) -> dict[str, int]:
    peaks, over = {}, []
    for pod in d.sim.pods.values():
        for c in pod.containers:
            limit = podsim.quantity(c.spec["resources"]["limits"]["memory"])
            peaks[f"{pod.name}/{c.name}"] = c.peak_rss
            if c.peak_rss > limit:
                over.append(f"{pod.name}/{c.name}: {c.peak_rss / GiB:.2f} GiB of a {limit / GiB:.2f} GiB limit")
    assert not over, "containers over their memory limit (summed RSS of their processes):\n" + "\n".join(over)
    return peaks


# ---- the tests -------------------------------------------------------------------------------------------


@pytest.mark.timeout(READY_S + 2 * JOB_S + 2 * TRAINING_S)
def test_dev_overlay_end_to_end(pods_allowed):
    t0 = time.monotonic()
    with deployment("overlays/dev-cpu") as d:
        d.wait("the API's /readyz", d.ready, READY_S, interval_s=2.0)
        node = check_only_the_worker_runs_an_agent(d)

        job = wait_job(d, submit_rest_job(d, "rest-tiny")["id"])
        assert job["node_id"] == node["node_id"], job
        final = d.shared / "jobs" / TENANT / job["id"] / "final"  # <jobs root>/<tenant>/<job id>
        assert (final / "config.json").is_file(), f"no final model on the shared volume at {final}"
        assert final.stat().st_uid == 1000, "the engine ran as the pod's user"

        check_no_ray_port_answers_without_the_token(d)

        # The RayJob example as shipped: its 7B spec fits no pod of the dev overlay, and the coordinator
        # says so; the submitter pod fails (the RayJob fails) with that reason.
        example = d.sim.doc("RayJob")
        shipped = run_rayjob(d, example, "finetune-qwen-7b-4xk2p", 40)
        log = shipped.containers[0].tail(20000)
        assert shipped.phase == "Failed", log
        assert "no node can ever hold this job" in log and "host RAM" in log, log
        # As the example tells a dev-cpu user: name the dev overlay's spec instead.
        dev = copy.deepcopy(example)
        dev["spec"]["entrypoint"] = dev["spec"]["entrypoint"].replace("qwen2.5-7b-sft.yaml",
                                                                      "qwen2.5-0.5b-lora-dev.yaml")
        assert dev["spec"]["entrypoint"] != example["spec"]["entrypoint"]
        edited = run_rayjob(d, dev, "finetune-qwen-dev-9mz3w", 41)
        assert edited.phase == "Succeeded", edited.containers[0].tail(20000) + d.sim.dump()
        jobs = d.get("/finetune", params={"limit": 50}).json()["data"]
        ray_job = next((j for j in jobs if j.get("name") == "qwen2.5-0.5b-lora-dev"), jobs)  # the spec's name
        assert ray_job["status"] == "succeeded" and ray_job["node_id"] == node["node_id"], ray_job

        # The worker pod is deleted (a node drain) while a job trains on it: its preStop hook has the engine
        # checkpoint the step it is at and stop; the job resumes from that step on the pod that replaces it.
        long = submit_rest_job(d, "rest-drained", max_steps=100000, checkpoint_every=100000)
        d.wait("the long job to train a few steps",
               lambda: d.get(f"/finetune/{long['id']}").json()["progress"]["step"] >= 5, JOB_S, job_id=long["id"])
        hooks = d.sim.pods[d.worker].stop()
        hook = hooks["ray-worker"]
        assert hook.returncode == 0 and "every engine stopped" in hook.stdout, (hook.stdout, hook.stderr)
        worker = d.sim.add_pod(d.worker.replace("m4c2z", "r7n5t"), d.sim.pods[d.worker].template, 21)
        d.worker = worker.name
        d.sim.start(worker.name)
        metrics = d.shared / "jobs" / TENANT / long["id"] / "metrics.jsonl"

        def resumed() -> list[Any] | None:
            lines = [json.loads(x) for x in metrics.read_text().splitlines()]
            starts = [x.get("resumed_from") for x in lines if x["type"] == "start"]
            return starts if len(starts) == 2 and lines[-1]["type"] == "metrics" else None

        starts = d.wait("the drained job to resume on the new worker and train", resumed, JOB_S, job_id=long["id"])
        drained = [c["step"] for c in d.get(f"/finetune/{long['id']}/checkpoints").json()["data"]]
        assert drained and drained[0] >= 5 and starts == [None, drained[0]], (drained, starts)  # the drain's
        moved = d.get(f"/finetune/{long['id']}").json()
        assert moved["status"] == "running" and moved["attempts"] == 2 and moved["node_id"] != node["node_id"], \
            moved
        assert d.post(f"/finetune/{long['id']}/cancel", {}).status_code == 200
        d.wait("the cancel", lambda: d.get(f"/finetune/{long['id']}").json()["status"] == "cancelled", JOB_S,
               job_id=long["id"])
        node = alive_nodes(d)[0]

        # The head dies (its pod is recreated, as KubeRay does): the API notices, reconnects and is ready
        # again; the job table on the state volume survives; the worker rejoins the new head.
        head = d.sim.pods[d.head]
        head.crash()
        d.wait("the API to notice the head is gone", lambda: not d.ready(), 120)
        head.start()
        d.wait("the API's /readyz after the head restart", d.ready, READY_S, interval_s=2.0)
        assert d.get(f"/finetune/{job['id']}").json()["status"] == "succeeded"
        d.wait("the worker to rejoin the new head", lambda: len(alive_nodes(d)) == 1, READY_S, 2.0)
        assert d.sim.pods[d.api].containers[0].restarts == 0, "the API survived the head restart in place"

        peaks = check_memory_within_limits(d)
    print(f"dev overlay end to end: {time.monotonic() - t0:.0f} s; peak memory per container (GiB): "
          + ", ".join(f"{k.split('/')[-1]}={v / GiB:.2f}" for k, v in peaks.items()))


@pytest.mark.parametrize("variant", ["base", "overlays/h200-2tib", "overlays/h200-2tib-node"])
def test_gpu_overlays_serve_and_train_on_their_worker(pods_allowed, variant):
    """The GPU overlays' pods on this GPU-less machine: the worker's engines run on the CPU (device cpu)."""
    with deployment(variant) as d:
        d.wait("the API's /readyz", d.ready, READY_S, interval_s=2.0)
        node = check_only_the_worker_runs_an_agent(d)
        job = wait_job(d, submit_rest_job(d, "rest-tiny")["id"])
        assert job["node_id"] == node["node_id"], job
        if variant == "overlays/h200-2tib-node":
            # a job over several ranks of the one pod, asked for in the REST body (resources.gpus): here, without
            # GPUs, two ranks on the CPU over one host copy of the model
            ranks = wait_job(d, submit_rest_job(d, "rest-ranks", gpus=2)["id"])
            assert ranks["node_id"] == node["node_id"] and ranks["spec"]["resources"] == {"gpus": 2}, ranks
            out = d.shared / "jobs" / TENANT / ranks["id"]
            start = next(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                         if json.loads(x)["type"] == "start")
            assert start["gpus"] == 2 and start["device"] == "cpu", start  # two ranks ran it
            assert (out / "final" / "config.json").is_file(), f"no final model on the shared volume at {out}"


def test_a_wait_on_a_job_that_ends_between_its_two_reads_returns_what_it_waited_for():
    """The predicate reads the job running, then the job ends before the wait checks whether it has: the wait
    asks once more rather than failing with "ended succeeded while waiting for it to end" (two CI failures)."""
    d = object.__new__(Deployment)
    reads = iter([None, {"status": "succeeded"}])
    d._ended = lambda job_id: "succeeded"  # type: ignore[method-assign]
    assert d.wait("the job to end", lambda: next(reads), 5, interval_s=0, job_id="job-1") == {"status": "succeeded"}
