"""Multi-GPU nodes: one engine per GPU, all drawing on the node's one RAM ledger, with the cores split among
them. Logical GPUs on simulated nodes (no GPU, no Ray): the coordinator with fake agents for placement,
the real NodeAgent with a stand-in engine for what each child process sees."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from horizon_ray.cluster import JobRejected, JobStatus
from horizon_ray.cluster.agent import NodeAgent, engine_env
from horizon_ray.cluster.agent_protocol import ReservationRefused
from horizon_ray.cluster.gpus import detect_gpus
from horizon_ray.cluster.ledger import Ledger
from horizon_ray.cluster.messages import Launch
from horizon_ray.cluster.nodes import SimulatedNode, parse_simulated_cluster, parse_simulated_nodes
from horizon_ray.cluster.placement import needs_gpu

GiB, MiB = 2**30, 2**20
H200_MEMORY = 143771 * MiB


def spec(size: str = "10GiB", device: str = "cuda", steps: int = 100, every: int = 0) -> dict:
    return {"model": {"path": f"/models/{size}"}, "data": {"path": "/data/train.jsonl"},
            "training": {"max_steps": steps}, "checkpoint": {"every_steps": every}, "engine": {"device": device}}


def agents(c):
    return c.coordinator.fake_agents


def env_of(c, job):
    return agents(c)[job.node_id].jobs[job.id].env


# ---- declaring nodes -----------------------------------------------------------------------------------


def test_simulated_nodes_declare_logical_gpus_and_cores_strictly():
    nodes = parse_simulated_cluster("a=16GiB, b=512GiB:4gpu,c=1TiB:8gpu@80GiB:64cpu,d=8GiB:2cpu")
    assert nodes == {"a": SimulatedNode(16 * GiB), "b": SimulatedNode(512 * GiB, 4, H200_MEMORY),
                     "c": SimulatedNode(2**40, 8, 80 * GiB, 64), "d": SimulatedNode(8 * GiB, cpu_count=2)}
    assert parse_simulated_nodes("a=16GiB,b=512GiB:4gpu") == {"a": 16 * GiB, "b": 512 * GiB}
    for bad, words in (("a=1GiB:4gpux", "neither Ngpu"), ("a=1GiB:2gpu:3gpu", "GPUs twice"),
                       ("a=1GiB:0gpu", "declares no GPU"), ("a=1GiB:gpu", "neither Ngpu"),
                       ("a=1GiB:2gpu@lots", "GPU memory of node a"), ("a=1GiB:0cpu", "no core"),
                       ("a=1GiB:", "neither Ngpu"), ("a=1GiB/4", "RAM of node a"), ("a:2gpu", "NAME=RAM"),
                       ("a=16", "RAM of node a: '16' has no unit"), ("a=8GiB:1gpu@80", "'80' has no unit")):
        with pytest.raises(ValueError, match=words):
            parse_simulated_cluster(bad)


def test_the_gpu_rule_follows_engine_device():
    assert needs_gpu(spec(device="cuda"), 0) and needs_gpu(spec(device="cuda:3"), 2)
    assert not needs_gpu(spec(device="cpu"), 8)
    assert needs_gpu(spec(device="auto"), 2) and not needs_gpu(spec(device="auto"), 0)
    assert needs_gpu({"model": {"path": "x"}}, 1)  # no engine section: the default, auto


def test_ledger_hands_out_distinct_gpus_and_splits_cores():
    ledger = Ledger(ram_bytes=64 * GiB, gpu_count=2, gpu_memory_bytes=H200_MEMORY, cpu_count=16)
    a = ledger.reserve("a", 10 * GiB, GiB, needs_gpu=True)
    b = ledger.reserve("b", 10 * GiB, GiB, needs_gpu=True)
    assert (a.gpu_index, b.gpu_index) == (0, 1)
    assert a.cpu_threads == b.cpu_threads == 8  # 16 cores / 2 GPUs, whatever the start order
    with pytest.raises(ReservationRefused, match="all 2 GPUs busy"):
        ledger.reserve("c", GiB, GiB, needs_gpu=True)
    cpu = ledger.reserve("cpu", GiB, 0, needs_gpu=False)
    assert cpu.gpu_index is None and cpu.cpu_threads == 5  # an equal share with the 2 engines running
    ledger.release("a")
    assert ledger.reserve("c", GiB, GiB, needs_gpu=True).gpu_index == 0  # the freed GPU
    with pytest.raises(ReservationRefused, match="the node has none"):
        Ledger(ram_bytes=GiB).reserve("x", 1, 0, needs_gpu=True)


def test_ledger_gives_a_job_its_gpus_together_with_their_cores():
    """resources.gpus N: N free GPUs of the node at once, each GPU's share of the cores, all of them visible."""
    ledger = Ledger(ram_bytes=64 * GiB, gpu_count=4, gpu_memory_bytes=H200_MEMORY, cpu_count=16)
    one = ledger.reserve("one", GiB, GiB, needs_gpu=True)
    two = ledger.reserve("two", GiB, GiB, needs_gpu=True, gpus=2)
    assert (one.gpu_indices, two.gpu_indices, two.gpu_index) == ([0], [1, 2], 1)
    assert (one.cpu_threads, two.cpu_threads) == (4, 8)
    with pytest.raises(ReservationRefused, match="1 of 4 GPUs free, the job needs 2"):
        ledger.reserve("three", GiB, GiB, needs_gpu=True, gpus=2)
    env = engine_env(two, ["0", "1", "2", "3"])
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and env["OMP_NUM_THREADS"] == "8"
    assert env["HORIZON_RAY_OPTIMIZER_THREADS"] == "6"  # the job's; its ranks split it (job.ranks.rank_config)
    ledger.release("one")
    assert ledger.reserve("three", GiB, GiB, needs_gpu=True, gpus=2).gpu_indices == [0, 3]


def test_each_rank_gets_its_share_of_the_jobs_optimizer_threads():
    from horizon_ray.engine import EngineConfig
    from horizon_ray.job.ranks import rank_config

    cfg = EngineConfig(device="cuda", optimizer_threads=12)
    assert [(c.device, c.optimizer_threads) for c in (rank_config(cfg, r, 3) for r in range(3))] == \
        [("cuda:0", 4), ("cuda:1", 4), ("cuda:2", 4)]
    assert rank_config(EngineConfig(device="cpu", optimizer_threads=5), 1, 2).optimizer_threads == 2


def test_a_job_of_n_gpus_takes_n_free_gpus_of_one_node(fake_cluster):
    c = fake_cluster({"g": "512GiB:4gpu:16cpu", "s": "256GiB:1gpu:4cpu"}, auto=False,
                     tenants={"default": {"max_concurrent_jobs": 10}})
    two = lambda: {**spec(), "resources": {"gpus": 2}}  # noqa: E731
    a = c.submit("acme", two())
    assert (a.status, a.node_id, a.gpu_indices, a.gpu_index) == (JobStatus.RUNNING, "g", [0, 1], 0)
    assert env_of(c, a)["CUDA_VISIBLE_DEVICES"] == "0,1" and env_of(c, a)["OMP_NUM_THREADS"] == "8"
    placed = [e.data for e in c.events("acme", a.id) if e.data.get("to") == "running"]
    assert placed[0]["gpu_indices"] == [0, 1] and "GPUs 0,1" in placed[0]["reason"]
    one = c.submit("acme", spec())  # best fit: the small node, which could never take a 2-GPU job
    assert (one.node_id, one.gpu_indices) == ("s", [0])
    b = c.submit("acme", two())
    assert (b.node_id, b.gpu_indices) == ("g", [2, 3])
    waiting = c.submit("acme", two())
    assert waiting.status is JobStatus.QUEUED
    assert waiting.queue_reason == "waiting for 2 free GPUs of one node (node g: all 4 GPUs busy)"
    nodes = {n.node_id: n for n in c.nodes()}
    assert nodes["g"].busy_gpus == [0, 1, 2, 3] and nodes["s"].busy_gpus == [0]
    agents(c)["g"].advance(a.id, 100)  # a ends: its two GPUs free together
    assert c.get("acme", waiting.id).gpu_indices == [0, 1]
    with pytest.raises(JobRejected, match=r"resources.gpus 5 needs 5 GPUs of one node and the most any node has is 4 "
                                          r"\(node g\); ask for at most 4"):
        c.submit("acme", {**spec(), "resources": {"gpus": 5}})


# ---- placement with the coordinator -------------------------------------------------------------------------


@pytest.fixture
def gpu_client(fake_cluster):
    return fake_cluster({"g": "512GiB:2gpu:8cpu"}, auto=False, tenants={"default": {"max_concurrent_jobs": 10}})


def test_concurrent_jobs_on_one_node_get_distinct_gpus_and_a_share_of_the_cores(gpu_client):
    c = gpu_client
    j1, j2 = c.submit("acme", spec("10GiB")), c.submit("beta", spec("20GiB", device="auto"))
    assert j1.status is j2.status is JobStatus.RUNNING and j1.node_id == j2.node_id == "g"
    assert (j1.gpu_index, j2.gpu_index) == (0, 1)
    assert env_of(c, j1) == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                             "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "HORIZON_RAY_OPTIMIZER_THREADS": "2"}
    assert env_of(c, j2)["CUDA_VISIBLE_DEVICES"] == "1" and env_of(c, j2)["OMP_NUM_THREADS"] == "4"
    (node,) = c.nodes()
    assert node.busy_gpus == [0, 1] and node.free_gpus == 0 and node.reserved_bytes == 30 * GiB
    assert [(r.job_id, r.gpu_index, r.cpu_threads) for r in node.ledger] == [(j1.id, 0, 4), (j2.id, 1, 4)]
    placed = [e.data for e in c.events("acme", j1.id) if e.data.get("to") == "running"]
    assert placed[0]["gpu_index"] == 0 and "GPU 0" in placed[0]["reason"]


def test_gpu_job_waits_for_a_gpu_though_ram_is_free_and_takes_the_one_freed(gpu_client):
    c = gpu_client
    j1, j2 = c.submit("acme", spec()), c.submit("acme", spec())
    waiting = c.submit("acme", spec())
    assert waiting.status is JobStatus.QUEUED and waiting.queue_position == 1
    assert waiting.queue_reason == "waiting for a free GPU (node g: all 2 GPUs busy)"
    assert c.nodes()[0].free_bytes == 492 * GiB  # RAM is not what it waits for
    dry = c.plan("acme", spec())
    assert dry["decision"] == "queue" and "all 2 GPUs busy" in dry["reason"]
    assert dry["nodes"][0]["free_gpus"] == 0 and dry["nodes"][0]["needs_gpu"]
    # A CPU job needs no GPU: it runs next to the two GPU engines, and its engine sees no GPU.
    cpu = c.submit("gamma", spec(device="cpu"))  # (beta's next jobs wait behind its first waiting one)
    assert cpu.status is JobStatus.RUNNING and cpu.gpu_index is None
    assert env_of(c, cpu)["CUDA_VISIBLE_DEVICES"] == "" and env_of(c, cpu)["OMP_NUM_THREADS"] == "2"
    assert c.get("acme", waiting.id).status is JobStatus.QUEUED

    agents(c)["g"].advance(j2.id, 100)  # j2 ends: GPU 1 frees
    rec = c.get("acme", waiting.id)
    assert rec.status is JobStatus.RUNNING and rec.gpu_index == 1 and env_of(c, rec)["CUDA_VISIBLE_DEVICES"] == "1"
    assert c.get("acme", j2.id).status is JobStatus.SUCCEEDED
    assert sorted(r.gpu_index for r in c.nodes()[0].ledger if r.gpu_index is not None) == [0, 1]
    agents(c)["g"].crash(j1.id)  # however a job ends, its GPU frees
    assert c.nodes()[0].busy_gpus == [1]


def test_gpus_and_ram_are_placed_together(fake_cluster):
    c = fake_cluster({"cpu": "64GiB", "big": "512GiB:2gpu", "small": "32GiB:1gpu"}, auto=False,
                          tenants={"default": {"max_concurrent_jobs": 10}})
    # Best fit on RAM among the nodes with a free GPU: small, then big (small's one GPU is busy).
    first, second = c.submit("acme", spec("10GiB")), c.submit("acme", spec("10GiB"))
    assert (first.node_id, first.gpu_index, second.node_id, second.gpu_index) == ("small", 0, "big", 0)
    # auto is a GPU job on a GPU node and a CPU job on a GPU-less one: best fit picks the CPU node here.
    auto = c.submit("acme", spec("40GiB", device="auto"))
    assert auto.node_id == "cpu" and auto.gpu_index is None and env_of(c, auto)["CUDA_VISIBLE_DEVICES"] == ""
    # small has RAM but no free GPU, big has a GPU: a GPU job too big for small's RAM takes big's.
    third = c.submit("acme", spec("100GiB"))
    assert (third.node_id, third.gpu_index) == ("big", 1)
    waiting = c.submit("acme", spec("10GiB"))
    assert waiting.queue_reason == "waiting for a free GPU (node big: all 2 GPUs busy; node small: its 1 GPU busy)"
    # cuda on a cluster without GPUs can never run: rejected with the reason
    c2 = fake_cluster({"a": "64GiB"}, auto=False)
    with pytest.raises(JobRejected, match="needs a GPU and no node has one"):
        c2.submit("acme", spec(device="cuda"))


def test_recovery_reassigns_a_gpu_on_another_node(fake_cluster):
    c = fake_cluster({"a": "64GiB:2gpu", "b": "128GiB:2gpu"}, auto=False,
                          tenants={"default": {"max_concurrent_jobs": 10}})
    first, second = (c.submit("acme", spec("30GiB", every=1)) for _ in range(2))
    other = c.submit("beta", spec("30GiB"))
    assert [(j.node_id, j.gpu_index) for j in (first, second, other)] == [("a", 0), ("a", 1), ("b", 0)]
    agents(c)["a"].advance(second.id, 2)
    c.tick()
    agents(c)["a"].kill()
    c.tick()
    # Recovering jobs go first, oldest first: b's free GPU goes to the first; the second has RAM on b
    # (68 GiB free) but no GPU, and waits for one.
    first, second = c.get("acme", first.id), c.get("acme", second.id)
    assert (first.status, first.node_id, first.gpu_index, first.attempts) == (JobStatus.RUNNING, "b", 1, 2)
    assert env_of(c, first)["CUDA_VISIBLE_DEVICES"] == "1"
    assert second.status is JobStatus.RECOVERING
    assert "all 2 GPUs busy" in second.queue_reason and "resumes from checkpoint step 2" in second.queue_reason
    agents(c)["b"].advance(other.id, 100)
    second = c.get("acme", second.id)
    assert (second.status, second.node_id, second.gpu_index) == (JobStatus.RUNNING, "b", 0)
    assert agents(c)["b"].jobs[second.id].step == 2 and env_of(c, second)["CUDA_VISIBLE_DEVICES"] == "0"


def test_cpu_jobs_on_a_gpu_less_node_split_its_cores(fake_cluster):
    c = fake_cluster({"n": "64GiB:8cpu"}, auto=False)
    first, second = c.submit("acme", spec(device="auto")), c.submit("acme", spec(device="cpu"))
    assert env_of(c, first)["OMP_NUM_THREADS"] == "8" and env_of(c, second)["OMP_NUM_THREADS"] == "4"
    assert env_of(c, first)["HORIZON_RAY_OPTIMIZER_THREADS"] == "8" and first.gpu_index is None


def test_the_real_planner_plans_gpu_jobs_for_a_full_node(fake_cluster):
    c = fake_cluster({"n": "1TiB:2gpu", "cpu": "1TiB"}, auto=False)
    seven_b = {"model": {"path": "qwen2.5-7b"}, "data": {"path": "/d.jsonl"}, "training": {"max_steps": 1}}
    dry = c.plan("acme", seven_b)
    by_node = {n["node_id"]: n for n in dry["nodes"]}
    assert by_node["n"]["needs_gpu"] and not by_node["cpu"]["needs_gpu"] and by_node["n"]["gpu_bytes"] > 0
    job = c.submit("acme", {**seven_b, "engine": {"device": "cuda"}})
    # one engine per GPU, both sharing the host: the step time the job sees when the node is full
    assert job.node_id == "n" and job.plan["concurrent_engines"] == 2 and job.plan["device"] == "cuda"
    assert "with 2 engines sharing the host" in job.plan["reason"]
    cpu = c.plan("acme", {**seven_b, "engine": {"device": "cpu"}})
    assert cpu["plan"]["concurrent_engines"] == 1 and cpu["plan"]["device"] == "cpu"


# ---- the real agent: what each child process sees -------------------------------------------------------

# Stands in for `python -m horizon_ray finetune --config spec.yaml --resume`: records its environment, then
# runs until told to stop (a file named "release" in its output_dir).
ENV_STAND_IN = textwrap.dedent("""
    import json, os, sys, time, yaml
    spec = yaml.safe_load(open(sys.argv[sys.argv.index("--config") + 1]))
    out = spec["output_dir"]
    keys = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "HORIZON_RAY_OPTIMIZER_THREADS", "HORIZON_RAY_JOB_ID")
    record = {k: os.environ.get(k) for k in keys}
    record["device"] = spec.get("engine", {}).get("device")
    with open(os.path.join(out, "env.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, "env.json.tmp"), os.path.join(out, "env.json"))
    while not os.path.exists(os.path.join(out, "release")):
        time.sleep(0.05)
""")


@pytest.fixture
def gpu_agent(tmp_path):
    script = tmp_path / "env_stand_in.py"
    script.write_text(ENV_STAND_IN)
    a = NodeAgent("g", ram_bytes=64 * GiB, gpu_count=2, gpu_memory_bytes=H200_MEMORY, cpu_count=8,
                  command=[sys.executable, str(script)], sample_interval_s=0.05, kill_grace_s=2.0)
    yield a
    a.shutdown()


def launch(agent, tmp_path, job_id, device, host=GiB):
    out = tmp_path / job_id
    res = agent.start(Launch(job_id=job_id, tenant="acme", spec={"engine": {"device": device}}, output_dir=str(out),
                             host_bytes=host, gpu_bytes=GiB if device != "cpu" else 0))
    return out, res


def seen(out: Path, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while not (out / "env.json").exists():
        assert time.time() < deadline, f"{out} never recorded its environment"
        time.sleep(0.05)
    return json.loads((out / "env.json").read_text())


def test_each_child_sees_only_its_gpu_and_its_share_of_the_cores(gpu_agent, tmp_path):
    a = gpu_agent
    out1, r1 = launch(a, tmp_path, "j1", "cuda")
    out2, r2 = launch(a, tmp_path, "j2", "cuda:1")  # the agent picks the GPU; the child sees it as cuda:0
    out3, r3 = launch(a, tmp_path, "j3", "cpu")
    e1, e2, e3 = seen(out1), seen(out2), seen(out3)
    assert (r1.gpu_index, r2.gpu_index, r3.gpu_index) == (0, 1, None)
    assert e1 == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "OMP_NUM_THREADS": "4",
                  "MKL_NUM_THREADS": "4", "HORIZON_RAY_OPTIMIZER_THREADS": "2", "HORIZON_RAY_JOB_ID": "j1",
                  "device": "cuda"}
    assert e2["CUDA_VISIBLE_DEVICES"] == "1" and e2["device"] == "cuda" and e2["OMP_NUM_THREADS"] == "4"
    assert e3["CUDA_VISIBLE_DEVICES"] == "" and e3["OMP_NUM_THREADS"] == "2"  # 8 cores // 3 engines
    info = a.info()
    assert info.busy_gpus == [0, 1] and info.cpu_count == 8
    with pytest.raises(ReservationRefused, match="all 2 GPUs busy"):
        launch(a, tmp_path, "j4", "auto")  # RAM is free, the GPUs are not
    (out1 / "release").write_text("")
    deadline = time.time() + 30
    while a.poll({})["j1"].exit is None:
        assert time.time() < deadline
        time.sleep(0.05)
    assert a.info().busy_gpus == [1]  # its GPU freed with its exit
    out4, r4 = launch(a, tmp_path, "j4", "auto")
    assert r4.gpu_index == 0 and seen(out4)["CUDA_VISIBLE_DEVICES"] == "0"
    a.forget("j2")  # killed: its GPU frees too, once the process is reaped
    deadline = time.time() + 30
    while a.info().busy_gpus != [0]:
        assert time.time() < deadline, a.info().busy_gpus
        time.sleep(0.05)


def test_thread_variables_given_to_the_agent_win(tmp_path):
    script = tmp_path / "env_stand_in.py"
    script.write_text(ENV_STAND_IN)
    a = NodeAgent("g", ram_bytes=8 * GiB, gpu_count=1, gpu_memory_bytes=H200_MEMORY, cpu_count=8,
                  command=[sys.executable, str(script)], env={"OMP_NUM_THREADS": "1"})
    try:
        out, _ = launch(a, tmp_path, "j", "auto")
        e = seen(out)
        assert e["OMP_NUM_THREADS"] == "1" and e["HORIZON_RAY_OPTIMIZER_THREADS"] == "6"  # 8 cores, 2 kept
        assert e["CUDA_VISIBLE_DEVICES"] == "0"
    finally:
        a.shutdown()


def test_real_gpus_are_read_from_nvidia_smi_and_cuda_visible_devices(tmp_path, monkeypatch):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\nprintf '0, GPU-aaaa, 143771\\n1, GPU-bbbb, 143771\\n2, GPU-cccc, 81559\\n'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    assert detect_gpus({}) == (["0", "1", "2"], 81559 * MiB)
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "1,0"}) == (["1", "0"], 143771 * MiB)
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "GPU-bb,7,2"}) == (["GPU-bb"], 143771 * MiB)  # stops at 7
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ([], 0)
    agent = NodeAgent("real", ram_bytes=GiB, env={"CUDA_VISIBLE_DEVICES": "2"})
    try:
        info = agent.info()
        assert (info.gpu_count, info.gpu_memory_bytes) == (1, 81559 * MiB)
    finally:
        agent.shutdown()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert detect_gpus({}) == ([], 0)
    assert detect_gpus({"NVIDIA_VISIBLE_DEVICES": "3,5"}) == (["0", "1"], 0)


def test_node_ram_prefers_the_declared_pod_limit():
    from horizon_ray.cluster.cgroups import node_ram_bytes

    assert node_ram_bytes({"HORIZON_NODE_RAM_BYTES": str(120 * 2**30)}) == 120 * 2**30
    import psutil

    assert 0 < node_ram_bytes({}) <= psutil.virtual_memory().total


def test_the_runner_hands_the_agents_core_share_to_the_engine(monkeypatch, tmp_path):
    from horizon_ray.job.runner import engine_config
    from horizon_ray.jobspec import JobSpec

    spec = JobSpec.from_dict({"model": {"path": str(tmp_path)}, "data": {"path": str(tmp_path / "d.jsonl")},
                              "training": {"max_steps": 1}, "engine": {"device": "cpu"},
                              "output_dir": str(tmp_path / "out")})
    monkeypatch.setenv("HORIZON_RAY_OPTIMIZER_THREADS", "6")
    assert engine_config(spec).optimizer_threads == 6
    monkeypatch.delenv("HORIZON_RAY_OPTIMIZER_THREADS")
    assert engine_config(spec).optimizer_threads == 0


def test_small_jobs_do_not_starve_a_job_of_several_gpus(fake_cluster):
    """The earliest waiting job in fair order holds the node it waits for: a later 1-GPU job of another tenant
    may not take the GPU it needs (that stream would keep a 2-GPU job waiting for ever); a CPU job that leaves
    it its RAM may run beside it."""
    c = fake_cluster({"g": "512GiB:4gpu:16cpu"}, auto=False, tenants={"default": {"max_concurrent_jobs": 10}})
    small = [c.submit("beta", spec()) for _ in range(3)]
    assert [j.gpu_indices for j in small] == [[0], [1], [2]]
    big = c.submit("acme", {**spec(), "resources": {"gpus": 2}})
    assert big.queue_reason == "waiting for 2 free GPUs of one node (node g: 1 of 4 GPUs free, the job needs 2)"
    later = c.submit("beta", spec())
    assert later.status is JobStatus.QUEUED and c.nodes()[0].free_gpus == 1
    assert f"node g is held for job {big.id}, which waits for it" in c.get("beta", later.id).queue_reason
    cpu = c.submit("gamma", spec(device="cpu"))  # (beta's next jobs wait behind its first waiting one)
    assert cpu.status is JobStatus.RUNNING
    agents(c)["g"].advance(small[0].id, 100)  # one GPU frees: with the one kept free, the big job starts
    assert c.get("acme", big.id).gpu_indices == [0, 3]
    assert c.get("beta", later.id).status is JobStatus.QUEUED
