"""What a node's kernel and its cgroup say about it: its RAM and cores as a pod's limits cut them, the memory
still available, and the OOM kills counted (the evidence the coordinator weighs when an engine dies of
SIGKILL). Read from /proc and /sys/fs/cgroup (v1 and v2); nothing here writes."""

from __future__ import annotations

import math
import os
from pathlib import Path

import psutil


def oom_kill_count(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup",
                   vmstat: str = "/proc/vmstat") -> int:
    """OOM kills counted so far by the kernel on this machine (/proc/vmstat) and in this process's memory
    cgroup (v2 memory.events, v1 memory.oom_control): a counter that grows when an OOM kill happens here. 0
    where neither is readable."""
    total = 0
    for line in _read(Path(vmstat)).splitlines():
        if line.startswith("oom_kill "):
            total += int(line.split()[1])
    for d in _memory_cgroup_dirs(proc_cgroup, cgroup_root):
        for name in ("memory.events", "memory.oom_control"):
            for line in _read(d / name).splitlines():
                if line.startswith("oom_kill "):
                    return total + int(line.split()[1])
    return total


def available_memory_bytes(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Memory this node can still hand out: the machine's available memory, or what its memory cgroup's limit
    leaves when that is less (a pod)."""
    available = psutil.virtual_memory().available
    for d in _memory_cgroup_dirs(proc_cgroup, cgroup_root):
        for limit_name, usage_name in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            limit, usage = _read(d / limit_name), _read(d / usage_name)
            if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
                return min(available, max(0, int(limit) - int(usage)))
    return available


def _memory_cgroup_dirs(proc_cgroup: str, cgroup_root: str) -> list[Path]:
    """This process's memory cgroup directory (v2, or v1's memory controller), then the mount's root (inside a
    container's cgroup namespace the path is "/" and the mount is the container's own cgroup)."""
    out = []
    for line in _read(Path(proc_cgroup)).splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            mount = Path(cgroup_root)
        elif "memory" in controllers.split(","):
            mount = Path(cgroup_root) / "memory"
        else:
            continue
        out += [mount / path.lstrip("/"), mount]
    return [d for d in out if d.is_dir()]


def node_cpu_count(env: dict[str, str], *, proc_cgroup: str = "/proc/self/cgroup",
                   cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this node's engines may use: $HORIZON_NODE_CPUS (a pod's CPU limit, from the downward API),
    the cgroup's CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, rounded up), and the
    cores this process may run on, whichever is smallest. A pod's CPU limit is a quota, not an affinity: the
    affinity alone counts the host's cores (192 OpenMP threads per engine in a 24-CPU pod)."""
    cores = len(os.sched_getaffinity(0))
    text = (env.get("HORIZON_NODE_CPUS") or "").strip()
    if text:
        try:
            declared = float(text)
        except ValueError:
            declared = 0.0
        if not declared > 0:
            raise ValueError(f"HORIZON_NODE_CPUS={text!r} is not a number of cores; set it to the pod's CPU "
                             "limit (resourceFieldRef limits.cpu) or leave it unset")
        cores = min(cores, math.ceil(declared))
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """The smallest CPU quota (in cores) of this process's cgroup and its ancestors; None without one."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            for d in _cgroup_dirs(Path(cgroup_root), path):
                parts = _read(d / "cpu.max").split()
                if len(parts) == 2 and parts[0] != "max" and parts[0].isdigit() and parts[1].isdigit():
                    quotas.append(int(parts[0]) / max(1, int(parts[1])))
        elif "cpu" in controllers.split(","):  # cgroup v1
            for d in _cgroup_dirs(Path(cgroup_root) / controllers, path) + _cgroup_dirs(Path(cgroup_root) / "cpu",
                                                                                     path):
                q, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                if q.lstrip("-").isdigit() and int(q) > 0 and period.isdigit():
                    quotas.append(int(q) / max(1, int(period)))
    return min(quotas) if quotas else None


def _cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """The cgroup directory of `path` under `mount` and its ancestors up to the mount (inside a container's
    cgroup namespace the path is "/" and the mount is the container's own cgroup)."""
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def node_ram_bytes(env: dict[str, str]) -> int:
    """The RAM this node offers to jobs: $HORIZON_NODE_RAM_BYTES (a pod's memory limit, set by the k8s
    manifests), else the cgroup's memory limit when there is one, else the machine's RAM. In a container
    psutil sees the host's RAM, and planning against it would overcommit the pod."""
    if env.get("HORIZON_NODE_RAM_BYTES"):
        return int(env["HORIZON_NODE_RAM_BYTES"])
    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            return int(text)
    return total
