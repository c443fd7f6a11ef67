"""Kubernetes pods as local processes: a deployment's pods run on this machine with the commands, arguments,
environment, volumes and users of their manifests, each pod in its own network, and each container in its
own mount and PID namespaces (so that a container that opens a path its pod spec does not mount fails).

What stands in for what:
- the pod network: one network namespace per pod (its "pause" process holds it and the pod's hostname),
  joined by veth pairs to a bridge in a network namespace of its own; pods get addresses of 198.18.0.0/24
  (a benchmarking range, RFC 2544) that exist in these namespaces only. Nothing here touches the
  machine's own network: the test reaches a pod through `port_forward`, like `kubectl port-forward`;
- Services and DNS: the kubelet's /etc/hosts of each pod maps every Service name (short and cluster FQDN)
  to the address of the pod behind it;
- the kubelet: it builds each volume (PVC and emptyDir folders, ConfigMaps and Secrets in the kubelet's
  `..data` symlink layout, memory-backed emptyDirs under /dev/shm), fills downward-API variables from the
  declared requests and limits, runs init containers to completion, restarts containers as restartPolicy
  says, and on a pod stop sends SIGTERM, then SIGKILL after the grace period;
- KubeRay (v1.7, ray-operator/controllers/ray/common/pod.go): the Ray container's generated `ray start`
  command and environment, the worker's wait-gcs-ready init container, Ray's token in the Ray containers and
  the RayJob submitter, and the submitter's `ray job submit` command (common/job.go);
- the image (k8s/Dockerfile): this machine's root file system under a private writable layer, with what the
  Dockerfile adds (user 1000 and its home, /var/lib/horizon-ray, WORKDIR holding the project, ENV) and the
  project's virtual environment first on PATH.

Not simulated: cgroup limits (the limits reach the processes through the downward API only; the test
measures each container's memory instead), NetworkPolicy enforcement, the scheduler, image pulls.

Every process runs in a PID namespace whose init is killed when the process that started it dies (unshare
--kill-child), and every process this module starts gets SIGKILL when the test process dies, so nothing
outlives a test, even a crashed one. Needs root (mount, network and PID namespaces); `unavailable()` says why
not where it cannot run.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import os
import re
import secrets as pysecrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = Path(__file__).with_name("podsim_container.py")
FORWARDER = Path(__file__).with_name("podsim_forward.py")
SUBNET = "198.18.0"
NAMESPACE = "horizon-ray"
CLUSTER_DOMAIN = "svc.cluster.local"
KUBERAY_METRICS_PORT = "8080"
KUBERAY_AGENT_PORT = "52365"
SHM_DEFAULT = 64 << 20  # a container runtime's /dev/shm when no volume replaces it

try:
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux
    _LIBC = None


def _die_with_parent(parent: int) -> None:
    # between fork and exec of every process started here: SIGKILL when the test process dies
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen(argv, preexec_fn=functools.partial(_die_with_parent, os.getpid()),
                            start_new_session=True, **kwargs)


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60, **kwargs)


def unavailable() -> str | None:
    """Why pods cannot be simulated here, or None."""
    if os.geteuid() != 0:
        return "needs root: pods are simulated with mount, network and PID namespaces"
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux, iproute2)"
    probe = ("mkdir -p /tmp/.podsim-probe/u /tmp/.podsim-probe/w /tmp/.podsim-probe/m && "
             "mount -t overlay overlay -o lowerdir=/,upperdir=/tmp/.podsim-probe/u,workdir=/tmp/.podsim-probe/w "
             "/tmp/.podsim-probe/m && ip link add podsim0 type veth peer name podsim1 && mount -t proc proc /proc")
    try:
        out = subprocess.run(["unshare", "--mount", "--net", "--uts", "--pid", "--fork", "--propagation", "private",
                              "sh", "-c", probe], capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree("/tmp/.podsim-probe", ignore_errors=True)
    if out.returncode != 0:
        return f"mount, network or PID namespaces are not allowed here: {out.stderr.strip()[:300]}"
    return None


# ---- Kubernetes values -------------------------------------------------------------------------------------


def quantity(text: str | int | float) -> float:
    m = re.fullmatch(r"([0-9.]+(?:[eE][+-]?[0-9]+)?)([KMGTPE]i|[numkMGTPE])?", str(text).strip())
    assert m, f"not a Kubernetes quantity: {text!r}"
    scale = {None: 1, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
             "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    return float(m.group(1)) * scale[m.group(2)]


def service_names(name: str) -> list[str]:
    return [name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.{CLUSTER_DOMAIN}"]


def head_service(cluster: dict[str, Any]) -> str:
    return f"{cluster['metadata']['name']}-head-svc"


def head_fqdn(cluster: dict[str, Any]) -> str:
    return f"{head_service(cluster)}.{NAMESPACE}.{CLUSTER_DOMAIN}"


# ---- KubeRay: the pods it makes of a RayCluster and a RayJob ---------------------------------------------


def _ray_start(params: dict[str, str], head: bool) -> str:
    flags = ""
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard",
                                                               "include-log-monitor"):
            flags += f" --{key} " if value.lower() == "true" else ""
        else:
            flags += f" --{key}={value} "
    return ("ray start --head " if head else "ray start ") + flags


def kuberay_pod(cluster: dict[str, Any], group: dict[str, Any] | None) -> dict[str, Any]:
    """The pod KubeRay v1.7 makes of the head group (`group` None) or of a worker group."""
    import copy

    head = group is None
    spec_group = cluster["spec"]["headGroupSpec"] if head else group
    template = copy.deepcopy(spec_group["template"])
    params = dict(spec_group.get("rayStartParams", {}))
    ray = template["spec"]["containers"][0]
    limits = ray.get("resources", {}).get("limits", {})
    fqdn = head_fqdn(cluster)
    if not head:
        params.setdefault("address", f"{fqdn}:6379")
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", KUBERAY_METRICS_PORT)
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", KUBERAY_AGENT_PORT)
    if "num-cpus" not in params and "cpu" in limits:
        params["num-cpus"] = str(math.ceil(quantity(limits["cpu"])))
    if "memory" not in params and "memory" in limits:
        params["memory"] = str(int(quantity(limits["memory"])))
    for key in sorted(limits):
        if key.endswith("gpu") and "num-gpus" not in params and quantity(limits[key]):
            params["num-gpus"] = str(int(quantity(limits[key])))
    start = _ray_start(params, head)
    command = " ".join(ray.get("command", []) + ray.get("args", []))
    if "ray start" not in command:
        generated = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; " + start
        ray["command"] = ["/bin/bash", "-c", "--"]
        ray["args"] = [f"{command} && {generated}" if command else generated]
    if not any(m["mountPath"] == "/dev/shm" for m in ray.get("volumeMounts", [])):
        template["spec"].setdefault("volumes", []).append(
            {"name": "shared-mem", "emptyDir": {"medium": "Memory", "sizeLimit": limits.get("memory")}})
        ray.setdefault("volumeMounts", []).append({"name": "shared-mem", "mountPath": "/dev/shm"})
    env = ray.setdefault("env", [])
    names = {e["name"] for e in env}

    def add(name: str, value: str | None = None, value_from: dict[str, Any] | None = None) -> None:
        if name not in names:
            env.append({"name": name, "value": value} if value_from is None else {"name": name,
                                                                                   "valueFrom": value_from})
            names.add(name)

    group_name = "headgroup" if head else group["groupName"]
    if not head:
        env.append({"name": "FQ_RAY_IP", "value": fqdn})
        env.append({"name": "RAY_IP", "value": head_service(cluster)})
    for name, path in (("RAY_CLUSTER_NAME", "metadata.labels['ray.io/cluster']"),
                       ("RAY_CLUSTER_NAMESPACE", "metadata.namespace"), ("RAY_CLOUD_INSTANCE_ID", "metadata.name"),
                       ("RAY_NODE_TYPE_NAME", "metadata.labels['ray.io/group']")):
        env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    env.append({"name": "KUBERAY_GEN_RAY_START_CMD", "value": start})
    add("RAY_PORT", "6379")
    add("RAY_ADDRESS", f"{'127.0.0.1' if head else fqdn}:6379")
    add("RAY_USAGE_STATS_KUBERAY_IN_USE", "1")
    if head:
        env.append({"name": "RAY_USAGE_STATS_EXTRA_TAGS", "value": "kuberay_version=v1.7.0;kuberay_crd=RayCluster"})
    add("RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "1")
    if cluster["spec"].get("authOptions", {}).get("mode") == "token":
        add("RAY_AUTH_MODE", "token")
        add("RAY_AUTH_TOKEN", value_from={"secretKeyRef": {"name": cluster["metadata"]["name"], "key": "auth_token"}})
    labels = template.setdefault("metadata", {}).setdefault("labels", {})
    labels.update({"ray.io/node-type": "head" if head else "worker", "ray.io/cluster": cluster["metadata"]["name"],
                   "ray.io/group": group_name, "ray.io/is-ray-node": "yes"})
    if not head:  # the worker waits for the GCS (an init container with the Ray container's env and mounts)
        template["spec"].setdefault("initContainers", []).append({
            "name": "wait-gcs-ready", "image": ray["image"], "command": ["/bin/bash", "-c", "--"],
            "args": [f"until ray health-check --address {fqdn}:6379 > /dev/null 2>&1; do "
                     "echo waiting for the GCS; sleep 2; done"],
            "securityContext": copy.deepcopy(ray.get("securityContext", {})),
            "env": copy.deepcopy([e for e in env if e["name"] not in ("FQ_RAY_IP", "RAY_IP")])
            + [{"name": "FQ_RAY_IP", "value": fqdn}, {"name": "RAY_IP", "value": head_service(cluster)}],
            "volumeMounts": copy.deepcopy(ray.get("volumeMounts", [])),
            "resources": {"requests": {"cpu": "200m", "memory": "256Mi"},
                          "limits": {"cpu": "200m", "memory": "256Mi"}}})
    return template


def kuberay_submitter_pod(job: dict[str, Any], cluster: dict[str, Any], submission_id: str) -> dict[str, Any]:
    """The K8sJobMode submitter pod KubeRay v1.7 makes of a RayJob that selects a running cluster."""
    import copy

    import yaml

    template = copy.deepcopy(job["spec"]["submitterPodTemplate"])
    c = template["spec"]["containers"][0]
    address = f"http://{head_fqdn(cluster)}:8265"
    runtime_env = json.dumps(yaml.safe_load(job["spec"]["runtimeEnvYAML"]), separators=(",", ":"))
    argv = (["if", "ray", "job", "status", "--address", address, submission_id, ">/dev/null", "2>&1", ";",
             "then", "ray", "job", "logs", "--address", address, "--follow", submission_id, ";", "else",
             "ray", "job", "submit", "--address", address, "--runtime-env-json", json.dumps(runtime_env),
             "--submission-id", submission_id, "--", job["spec"]["entrypoint"].strip(), ";", "fi"])
    c["command"] = ["/bin/bash", "-ce", "--"]
    c["args"] = [" ".join(argv)]
    env = c.setdefault("env", [])
    env += [{"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "RAY_DASHBOARD_ADDRESS", "value": f"{head_fqdn(cluster)}:8265"},
            {"name": "RAY_JOB_SUBMISSION_ID", "value": submission_id}]
    if cluster["spec"].get("authOptions", {}).get("mode") == "token":
        env += [{"name": "RAY_AUTH_MODE", "value": "token"},
                {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": cluster["metadata"]["name"],
                                                                          "key": "auth_token"}}}]
    template["spec"]["restartPolicy"] = "Never"
    return template


# ---- the image -------------------------------------------------------------------------------------------


@dataclass
class Image:
    """What k8s/Dockerfile gives a container: environment, user, working directory, folders."""

    env: dict[str, str]
    user: int
    workdir: str
    dirs: list[tuple[str, int, int, int]]  # path, uid, gid, mode
    login: str  # the name of `user`


def image_of(name: str, dockerfile: Path = ROOT / "k8s" / "Dockerfile") -> Image:
    """The stage of k8s/Dockerfile that builds image `name` ("...-api:TAG" is the `api` target)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    want_api = name.rsplit(":", 1)[0].endswith("-api")
    stage = next(s for s in stages if (" AS api" in s.splitlines()[0]) == want_api)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "LANG": "C.UTF-8"}
    for line in stage.splitlines():
        if line.startswith("ENV "):
            env.update(dict(re.findall(r"(\w+)=(\S+)", line[4:])))
    user = int(re.findall(r"^USER (\d+)", stage, re.M)[-1])
    workdir = re.findall(r"^WORKDIR (\S+)", stage, re.M)[-1]
    login = re.search(r"useradd ([^&\n]*)", stage).group(1).split()[-1]  # useradd ... NAME
    dirs = [(p, int(u), int(g), 0o755) for u, g, p in re.findall(r"install -d -o (\d+) -g (\d+) (\S+)", stage)]
    dirs.append((f"/home/{login}", user, user, 0o755))
    env["HOME"] = f"/home/{login}"
    return Image(env=env, user=user, workdir=workdir, dirs=dirs, login=login)


def host_mounts_for(paths: list[str]) -> list[str]:
    """Mount points (other than /) that hold `paths`: the container's image must see them (read-only)."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    out = []
    for p in paths:
        best = max((m for m in points if p == m or p.startswith(m.rstrip("/") + "/")), key=len, default="/")
        if best != "/" and best not in out:
            out.append(best)
    return out


# ---- the cluster network and the pods ---------------------------------------------------------------------


class Network:
    """A bridge in a network namespace of its own, to which every pod's namespace is joined."""

    def __init__(self) -> None:
        self.holder = popen(["unshare", "--net", "--", "sleep", "infinity"])
        self.netns = f"/proc/{self.holder.pid}/ns/net"
        self._wait_ns(self.holder.pid)
        self.ip(["link", "add", "br0", "type", "bridge"])
        self.ip(["addr", "add", f"{SUBNET}.1/24", "dev", "br0"])
        self.ip(["link", "set", "br0", "up"])
        self.ip(["link", "set", "lo", "up"])
        self._links = 0

    @staticmethod
    def _wait_ns(pid: int) -> None:
        me = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{pid}/ns/net") == me:  # until unshare has made the namespace
            assert time.monotonic() < deadline, "unshare did not create a network namespace"
            time.sleep(0.01)

    def ip(self, args: list[str]) -> None:
        run(["nsenter", f"--net={self.netns}", "ip", *args])

    def attach(self, pause_pid: int, address: str) -> None:
        """Give the pod namespace held by `pause_pid` an eth0 on the bridge with `address`."""
        self._links += 1
        host_end = f"veth{self._links}"
        self.ip(["link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", str(pause_pid)])
        self.ip(["link", "set", host_end, "master", "br0", "up"])
        pod = ["nsenter", f"--net=/proc/{pause_pid}/ns/net", "ip"]
        run(pod + ["addr", "add", f"{address}/24", "dev", "eth0"])
        run(pod + ["link", "set", "eth0", "up"])
        run(pod + ["link", "set", "lo", "up"])

    def close(self) -> None:
        kill(self.holder)


def kill(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class Container:
    pod: Pod
    spec: dict[str, Any]  # the container of the pod spec
    init: bool = False
    proc: subprocess.Popen | None = None
    restarts: int = 0
    peak_rss: int = 0  # bytes: the largest sum of its processes' RSS seen
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.pod.sim.workdir / "logs" / f"{self.pod.name}.{self.spec['name']}.log"

    @property
    def name(self) -> str:
        return self.spec["name"]

    def start(self) -> None:
        pod, sim = self.pod, self.pod.sim
        image = image_of(self.spec["image"])
        sc = {**pod.template["spec"].get("securityContext", {}), **self.spec.get("securityContext", {})}
        uid = int(sc.get("runAsUser", image.user))
        gid = int(sc.get("runAsGroup", uid))
        groups = sorted({gid, *([int(sc["fsGroup"])] if "fsGroup" in sc else [])})
        env = {**image.env, "HOSTNAME": pod.name, **pod.resolve_env(self.spec)}
        argv = list(self.spec.get("command", [])) + list(self.spec.get("args", []))
        assert argv, f"{pod.name}/{self.name}: no command (an image entrypoint is not simulated)"
        assert not any("$(" in a for a in argv), "$(VAR) expansion in command/args is not simulated"
        scratch = sim.workdir / "containers" / f"{pod.name}.{self.name}.{pod.incarnation}.{self.restarts}"
        scratch.mkdir(parents=True)
        binds = pod.binds(self.spec)
        shm = next((b for b in binds if b[1] == "/dev/shm"), None)
        spec = {"scratch": str(scratch), "binds": binds,
                "readonly_host_mounts": host_mounts_for([str(ROOT), sys.prefix, sys.base_prefix,
                                                         os.path.realpath(sys.executable)]),
                "image_dirs": [list(d) for d in image.dirs] + [[image.workdir, 0, 0, 0o755]],
                "readable": [str(ROOT), sys.prefix, sys.base_prefix, os.path.realpath(sys.executable)],
                "passwd": f"{image.login}:x:{image.user}:{image.user}::{image.env['HOME']}:/bin/bash",
                "hosts": str(pod.hosts_file), "uid": uid, "gid": gid, "groups": groups, "env": env,
                "argv": argv, "cwd": self.spec.get("workingDir", image.workdir),
                "shm_bytes": SHM_DEFAULT if shm is None else 1 << 20}
        # the image's WORKDIR holds the project (k8s/Dockerfile copies it there)
        spec["binds"] = [[str(ROOT), image.workdir, True]] + spec["binds"]
        spec_file = scratch / "spec.json"
        spec_file.write_text(json.dumps(spec))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            log.write(f"---- podsim: start {pod.name}/{self.name} (restart {self.restarts}) ----\n")
            log.flush()
            if pod.pid_ns_holder is None:  # a PID namespace of its own, whose init is the container's command
                pids = ["unshare", "--mount", "--pid", "--fork", "--kill-child=SIGKILL"]
            else:  # the pod's shared PID namespace
                pids = ["nsenter", f"--pid=/proc/{pod.pid_ns_holder}/ns/pid", "--", "unshare", "--mount"]
            self.proc = popen(["nsenter", f"--net=/proc/{pod.pause.pid}/ns/net",
                               f"--uts=/proc/{pod.pause.pid}/ns/uts", "--", *pids,
                               "--propagation", "private", "--",
                               sys.executable, str(LAUNCHER), str(spec_file)],
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list[Any]:
        import psutil

        if not self.running():
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def init_pid(self) -> int | None:
        """Host pid of the container's command: the init of its PID namespace (unshare forks it), or in a pod
        that shares one, the process nsenter forks into it (unshare execs it)."""
        import psutil

        try:
            p = psutil.Process(self.proc.pid) if self.running() else None
            while p is not None and p.name() in ("nsenter", "unshare"):
                kids = p.children()
                p = kids[0] if kids else None
        except psutil.NoSuchProcess:
            return None
        return None if p is None else p.pid

    def sample_memory(self) -> None:
        import psutil

        total = 0
        for p in self.processes():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak_rss = max(self.peak_rss, total)

    def stop(self, grace_s: float) -> None:
        """The kubelet's stop: SIGTERM to the container's PID 1, SIGKILL after the grace period."""
        if not self.running():
            return
        pid = self.init_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL: its PID namespace dies with its init; in a shared one, its processes are killed one by one."""
        if self.proc is None:
            return
        for p in self.processes():
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass
        kill(self.proc)

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Pod:
    """One pod: its network and hostname (held by a pause process), volumes, hosts file and containers."""

    def __init__(self, sim: Simulation, name: str, template: dict[str, Any], address: str):
        self.sim = sim
        self.name = name
        self.template = template
        self.address = address
        self.incarnation = 0
        self.pause: subprocess.Popen | None = None
        self.hosts_file = sim.workdir / "hosts" / name
        self.containers: list[Container] = []
        self.init_containers: list[Container] = []
        self._stop = threading.Event()  # the kubelet thread ends
        self._stopping = threading.Event()  # no more restarts
        self._kubelet: threading.Thread | None = None
        self.phase = "Pending"

    @staticmethod
    def _child_of(pid: int) -> int:
        import psutil

        deadline = time.monotonic() + 10
        while True:
            kids = psutil.Process(pid).children()
            if kids:
                return kids[0].pid
            assert time.monotonic() < deadline, f"unshare {pid} forked no init"
            time.sleep(0.01)

    @property
    def labels(self) -> dict[str, str]:
        return self.template.get("metadata", {}).get("labels", {})

    def container(self, name: str) -> Container:
        return next(c for c in self.containers if c.name == name)

    # -- the kubelet's part --

    def start(self) -> None:
        self.incarnation += 1
        self._stop.clear()
        self._stopping.clear()
        shared_pids = bool(self.template["spec"].get("shareProcessNamespace"))
        # the pause process: the pod's network and hostname, and with shareProcessNamespace its PID namespace
        # (whose init it is, as in Kubernetes)
        pid_ns = ["--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc"] if shared_pids else []
        self.pause = popen(["unshare", "--net", "--uts", *pid_ns, "--", "sh", "-c",
                            f"hostname {shlex.quote(self.name)} && exec sleep infinity"])
        Network._wait_ns(self.pause.pid)
        self.pid_ns_holder = None
        if shared_pids:
            self.pid_ns_holder = self._child_of(self.pause.pid)
        self.sim.net.attach(self.pause.pid, self.address)
        self._volumes = self.sim.make_volumes(self)
        spec = self.template["spec"]
        self.init_containers = [Container(self, c, init=True) for c in spec.get("initContainers", [])]
        self.containers = [Container(self, c) for c in spec["containers"]]
        self._kubelet = threading.Thread(target=self._run, name=f"kubelet-{self.name}", daemon=True)
        self._kubelet.start()

    def _run(self) -> None:
        policy = self.template["spec"].get("restartPolicy", "Always")
        for c in self.init_containers:
            while not self._stop.is_set():
                c.start()
                rc = c.proc.wait()
                if rc == 0:
                    break
                if policy == "Never":
                    self.phase = "Failed"
                    return
                c.restarts += 1
                self._stop.wait(min(8.0, 2.0 ** min(c.restarts, 3)))  # the kubelet's back-off, shortened
        if self._stop.is_set():
            return
        for c in self.containers:
            c.start()
        self.phase = "Running"
        backoff: dict[str, float] = {}
        while not self._stop.wait(0.5):
            for c in self.containers:
                c.sample_memory()
                if c.running() or self._stopping.is_set():
                    continue
                rc = c.proc.returncode
                if policy == "Never" or (policy == "OnFailure" and rc == 0):
                    continue
                delay = backoff.get(c.name, 1.0)  # the kubelet's crash-loop back-off, shortened
                self._stop.wait(delay)
                backoff[c.name] = min(delay * 2, 8.0)
                if not self._stop.is_set():
                    c.restarts += 1
                    c.start()
            if policy == "Never" and not any(c.running() for c in self.containers):
                self.phase = "Succeeded" if all(c.proc.returncode == 0 for c in self.containers) else "Failed"
                return

    def exec(self, container: str, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        """`kubectl exec`: run `argv` in a running container (its namespaces, root, user and environment)."""
        c = self.container(container)
        pid = c.init_pid()
        assert pid is not None, f"{self.name}/{container} is not running"
        spec = json.loads(Path(c.proc.args[-1]).read_text())
        return subprocess.run(["nsenter", "-t", str(pid), "-m", "-p", "-n", "-u", "-r", "-w",
                               "-S", str(spec["uid"]), "-G", str(spec["gid"]), "--",
                               "/usr/bin/env", "-i", *[f"{k}={v}" for k, v in spec["env"].items()], *argv],
                              capture_output=True, text=True, timeout=timeout)

    def wait_done(self, timeout_s: float) -> str:
        """For a restartPolicy Never pod: its phase once every container has exited."""
        deadline = time.monotonic() + timeout_s
        while self.phase in ("Pending", "Running") and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.phase

    def stop(self) -> dict[str, subprocess.CompletedProcess]:
        """A pod deletion (or a node drain's eviction), as the kubelet does it: each container's preStop hook
        runs, then the container gets SIGTERM, then SIGKILL when the pod's grace period is over. Returns the
        hooks' results. (The kubelet thread that started the containers stays until they are gone: their
        parent-death signal is its.)"""
        self._stopping.set()
        deadline = time.monotonic() + float(self.template["spec"].get("terminationGracePeriodSeconds", 30))
        hooks = {}
        for c in self.containers:
            hook = c.spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            if hook and c.running():
                try:
                    hooks[c.name] = self.exec(c.name, hook, timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired as exc:
                    hooks[c.name] = subprocess.CompletedProcess(hook, -9, exc.stdout or "", exc.stderr or "")
        for c in self.init_containers + self.containers:
            c.stop(max(0.0, deadline - time.monotonic()) if not c.init else 0)
        self._stop.set()
        if self._kubelet is not None:
            self._kubelet.join(timeout=10)
        kill(self.pause)
        self.phase = "Terminated"
        return hooks

    def crash(self) -> None:
        """The pod dies at once (node failure, OOM of its main process): SIGKILL everything."""
        self._stopping.set()
        self._stop.set()
        if self._kubelet is not None:
            self._kubelet.join(timeout=10)
        for c in self.init_containers + self.containers:
            c.kill()
        kill(self.pause)
        self.phase = "Terminated"

    # -- what a container sees --

    def resolve_env(self, c: dict[str, Any]) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                out[e["name"]] = str(e.get("value") or "")
                continue
            src = e["valueFrom"]
            if "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
                value = {"status.podIP": self.address, "metadata.name": self.name,
                         "metadata.namespace": NAMESPACE}.get(path)
                if label:
                    value = self.labels[label.group(1)]
                assert value is not None, f"fieldRef {path} is not simulated"
            elif "resourceFieldRef" in src:
                ref = src["resourceFieldRef"]
                target = next(x for x in self.template["spec"]["containers"]
                              if x["name"] == ref.get("containerName", c["name"]))
                kind, _, res = ref["resource"].partition(".")
                amount = quantity(target["resources"][kind][res])
                value = str(math.ceil(amount / quantity(ref.get("divisor", "1"))))  # the kubelet rounds up
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                value = self.sim.secret_data(ref["name"])[ref["key"]]
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                value = self.sim.configmap_data(ref["name"])[ref["key"]]
            else:
                raise AssertionError(f"env source {src} is not simulated")
            out[e["name"]] = value
        return out

    def binds(self, c: dict[str, Any]) -> list[list[Any]]:
        out = []
        for m in c.get("volumeMounts", []):
            source = self._volumes[m["name"]]
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists():  # the kubelet creates a missing subPath folder
                    source.mkdir(parents=True)
                    self.sim.own(source)
            out.append([str(source), m["mountPath"], bool(m.get("readOnly", False))])
        return out

    def write_hosts(self, services: dict[str, str]) -> None:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{self.address}\t{self.name}"]
        lines += [f"{ip}\t{' '.join(service_names(svc))}" for svc, ip in services.items()]
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text("\n".join(lines) + "\n")


class Simulation:
    """A namespace's worth of pods on this machine: network, volumes, Secrets and ConfigMaps, pods."""

    def __init__(self, workdir: Path, docs: list[dict[str, Any]]):
        self.workdir = workdir
        self.docs = docs
        self.shm_root = Path("/dev/shm") / f"podsim-{workdir.name}"
        self.secrets: dict[str, dict[str, str]] = {}
        self.pods: dict[str, Pod] = {}
        self.services: dict[str, str] = {}
        self._forwards: list[subprocess.Popen] = []
        self.net = Network()

    # -- objects --

    def doc(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [d for d in self.docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def create_secret(self, name: str, data: dict[str, str]) -> None:
        self.secrets[name] = dict(data)

    def secret_data(self, name: str) -> dict[str, str]:
        if name in self.secrets:
            return self.secrets[name]
        doc = self.doc("Secret", name)
        data = {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()}
        return {**data, **doc.get("stringData", {})}

    def configmap_data(self, name: str) -> dict[str, str]:
        return dict(self.doc("ConfigMap", name).get("data", {}))

    def claim_dir(self, claim: str) -> Path:
        self.doc("PersistentVolumeClaim", claim)  # it must be declared
        path = self.workdir / "pv" / claim
        if not path.exists():
            path.mkdir(parents=True)
            self.own(path)
        return path

    def own(self, path: Path) -> None:
        """A volume the kubelet gives fsGroup 1000 (group-owned, group-writable, setgid)."""
        os.chown(path, 0, 1000)
        os.chmod(path, 0o2775)

    def make_volumes(self, pod: Pod) -> dict[str, Path]:
        out = {}
        for v in pod.template["spec"].get("volumes", []):
            name = v["name"]
            if "persistentVolumeClaim" in v:
                out[name] = self.claim_dir(v["persistentVolumeClaim"]["claimName"])
                continue
            if "emptyDir" in v and v["emptyDir"].get("medium") == "Memory":
                path = self.shm_root / f"{pod.name}.{pod.incarnation}.{name}"
            else:
                path = self.workdir / "volumes" / f"{pod.name}.{pod.incarnation}.{name}"
            path.mkdir(parents=True)
            if "emptyDir" in v:
                self.own(path)
            elif "configMap" in v or "secret" in v:
                data = (self.configmap_data(v["configMap"]["name"]) if "configMap" in v
                        else self.secret_data(v["secret"]["secretName"]))
                atomic_write(path, data)
            else:
                raise AssertionError(f"volume {v} is not simulated")
            out[name] = path
        return out

    # -- pods --

    def add_pod(self, name: str, template: dict[str, Any], address_suffix: int, service: str | None = None) -> Pod:
        pod = Pod(self, name, template, f"{SUBNET}.{address_suffix}")
        self.pods[name] = pod
        if service:
            self.services[service] = pod.address
        return pod

    def start(self, *names: str) -> None:
        for pod in self.pods.values():
            pod.write_hosts(self.services)
        for name in names:
            self.pods[name].start()

    def port_forward(self, pod: str, port: int) -> int:
        """A port on 127.0.0.1 of this machine that reaches `port` of the pod."""
        proc = popen([sys.executable, str(FORWARDER), self.net.netns, self.pods[pod].address, str(port)],
                     stdout=subprocess.PIPE, text=True)
        self._forwards.append(proc)
        return int(proc.stdout.readline())

    def in_cluster(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `argv` in the cluster's network, as another pod of the cluster would (no Service names)."""
        return subprocess.run(["nsenter", f"--net={self.net.netns}", "--", *argv], capture_output=True, text=True,
                              timeout=timeout)

    def listening(self, pod: str) -> list[int]:
        """TCP ports the pod listens on at its own address or on every address."""
        pause = self.pods[pod].pause.pid
        ports = set()
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pause}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                parts = line.split()
                local, state = parts[1], parts[3]
                address, port = local.split(":")
                loopback = address in ("0100007F", "00000000000000000000000001000000",
                                        "0000000000000000FFFF00000100007F")
                if state == "0A" and not loopback:
                    ports.add(int(port, 16))
        return sorted(ports)

    def dump(self) -> str:
        """Every container's log tail (for a failure message)."""
        out = []
        for pod in self.pods.values():
            for c in pod.init_containers + pod.containers:
                out.append(f"==== {pod.name}/{c.name} (restarts {c.restarts}, running {c.running()}) ====\n"
                           f"{c.tail()}")
        return "\n".join(out)

    def close(self) -> list[int]:
        """Stop everything; returns the pids of processes found in the pods' namespaces afterwards (killed)."""
        namespaces = {os.readlink(f"/proc/{p.pause.pid}/ns/net") for p in self.pods.values()
                      if p.pause is not None and p.pause.poll() is None}
        for pod in self.pods.values():
            pod.crash()
        for proc in self._forwards:
            kill(proc)
        self.net.close()
        # the kernel kills what is left in a PID namespace whose init died; give it a moment
        deadline = time.monotonic() + 20
        while (leftovers := _in_namespaces(namespaces)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.shm_root, ignore_errors=True)
        return leftovers


def _in_namespaces(namespaces: set[str]) -> list[int]:
    """Live processes (not zombies) in any of the network namespaces."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "net") in namespaces and " Z " not in (entry / "stat").read_text():
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def atomic_write(directory: Path, files: dict[str, str]) -> None:
    """A ConfigMap or Secret volume as the kubelet writes it: <key> -> ..data/<key> -> ..<stamp>/<key>."""
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{pysecrets.token_hex(4)}"
    stamp.mkdir()
    for key, value in files.items():
        (stamp / key).write_text(value)
        os.chmod(stamp / key, 0o644)
    (directory / "..data").symlink_to(stamp.name)
    for key in files:
        (directory / key).symlink_to(f"..data/{key}")
