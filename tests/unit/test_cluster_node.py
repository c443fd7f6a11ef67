"""What a node offers its jobs when it is a pod: its CPU limit, its memory limit less Ray's share, the thread
variables its container sets; and which nodes get an agent at all."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from horizon_ray.cluster.agent import RAY_PROCESSES_BYTES, NodeAgent, engine_env
from horizon_ray.cluster.cgroups import node_cpu_count
from horizon_ray.cluster.messages import Reservation

GiB = 2**30


def test_cores_come_from_the_pods_cpu_limit_not_the_hosts(tmp_path):
    here = len(os.sched_getaffinity(0))
    no_cgroup = {"proc_cgroup": str(tmp_path / "none"), "cgroup_root": str(tmp_path)}
    assert node_cpu_count({}, **no_cgroup) == here
    assert node_cpu_count({"HORIZON_NODE_CPUS": "1"}, **no_cgroup) == 1
    # the downward API rounds limits.cpu up to whole cores; a fraction given by hand is rounded up too
    assert node_cpu_count({"HORIZON_NODE_CPUS": "0.5"}, **no_cgroup) == 1
    assert node_cpu_count({"HORIZON_NODE_CPUS": str(here + 64)}, **no_cgroup) == here  # never above affinity
    with pytest.raises(ValueError, match="HORIZON_NODE_CPUS='lots'.*limits.cpu"):
        node_cpu_count({"HORIZON_NODE_CPUS": "lots"}, **no_cgroup)


def _cgroup(tmp_path, proc: str, files: dict[str, str]):
    tmp_path.mkdir(parents=True)
    (tmp_path / "proc").write_text(proc)
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"proc_cgroup": str(tmp_path / "proc"), "cgroup_root": str(tmp_path / "fs")}


def test_cores_come_from_the_cgroup_quota(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to see a quota of 1 win")
    # cgroup v2, inside a container's cgroup namespace: "0::/" and the container's own cpu.max at the root
    v2 = _cgroup(tmp_path / "a", "0::/\n", {"cpu.max": "150000 100000\n"})
    assert node_cpu_count({}, **v2) == 2  # 1.5 cores of quota: 2 threads
    v2 = _cgroup(tmp_path / "b", "0::/kubepods/pod1/ctr\n", {"kubepods/pod1/cpu.max": "100000 100000\n",
                                                              "kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert node_cpu_count({}, **v2) == 1  # a parent's quota binds its children
    # cgroup v1: quota / period of the cpu controller; -1 is no limit
    v1 = _cgroup(tmp_path / "c", "2:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "100000\n",
                                                      "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert node_cpu_count({}, **v1) == 1
    unlimited = _cgroup(tmp_path / "d", "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us":
                                                      "100000\n"})
    assert node_cpu_count({}, **unlimited) == len(os.sched_getaffinity(0))


def test_an_agent_splits_the_pods_cores_among_its_engines(monkeypatch):
    monkeypatch.setenv("HORIZON_NODE_CPUS", "1")
    agent = NodeAgent("pod", ram_bytes=8 * GiB, gpu_count=0)
    try:
        assert agent.info().cpu_count == 1
    finally:
        agent.shutdown()


def test_the_ledger_keeps_rays_share_of_the_pods_memory():
    limit = 16 * GiB
    reserve = 2 * GiB + RAY_PROCESSES_BYTES  # a 2 GiB object store and Ray's processes
    agent = NodeAgent("pod", gpu_count=0, cpu_count=4, env={"HORIZON_NODE_RAM_BYTES": str(limit)},
                      ray_reserved_bytes=reserve)
    try:
        assert agent.info().ram_bytes == limit - reserve
    finally:
        agent.shutdown()
    with pytest.raises(ValueError, match="object-store-memory"):
        NodeAgent("tiny", gpu_count=0, cpu_count=1, env={"HORIZON_NODE_RAM_BYTES": str(GiB)},
                  ray_reserved_bytes=2 * GiB)


def test_rays_share_is_its_object_store_and_its_processes():
    from horizon_ray.cluster.ray_actors import ray_reserved_bytes

    node = {"NodeID": "ab" * 14, "Alive": True, "Resources": {"CPU": 16.0, "object_store_memory": 2.0 * GiB}}
    assert ray_reserved_bytes(node) == 2 * GiB + RAY_PROCESSES_BYTES


def test_thread_variables_the_container_sets_are_kept(tmp_path):
    from horizon_ray.cluster.ray_actors import node_thread_vars

    # Stands in for the raylet: a process started with the container's environment.
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "3", "OTHER": "x"}
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        deadline = time.monotonic() + 10
        kept = {}
        while not kept and time.monotonic() < deadline:  # its environ is readable once it has exec'd
            kept = node_thread_vars(raylet.pid)
        assert kept == {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "3"}
    finally:
        raylet.kill()
        raylet.wait()
    res = Reservation("j", GiB, 0, 0.0, gpu_indices=[], cpu_threads=4)
    assert engine_env(res, [], kept) == {"CUDA_VISIBLE_DEVICES": "", "HORIZON_RAY_OPTIMIZER_THREADS": "4"}
    assert engine_env(res, [], {})["OMP_NUM_THREADS"] == "4"


def test_no_agent_on_the_head_when_asked():
    from horizon_ray.cluster.ray_actors import agent_nodes

    head = {"NodeID": "h" * 28, "Alive": True, "Resources": {"node:__internal_head__": 1.0, "CPU": 0.0}}
    worker = {"NodeID": "w" * 28, "Alive": True, "Resources": {"CPU": 16.0}}
    gone = {"NodeID": "g" * 28, "Alive": False, "Resources": {"CPU": 16.0}}
    assert agent_nodes([head, worker, gone]) == [head, worker]
    assert agent_nodes([head, worker, gone], skip_head=True) == [worker]
