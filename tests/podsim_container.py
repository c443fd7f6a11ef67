"""Start one container of a simulated pod: run as root, as PID 1 of a new PID and mount namespace, inside the
pod's network and UTS namespaces (tests/podsim.py sets that up with nsenter and unshare).

    python podsim_container.py SPEC.json

It builds the container's file system the way a container runtime does, then drops to the pod's user and
execs the container's command:
- the image: this machine's root file system as a read-only lower layer of an overlay whose writable upper
  layer is private to the container (what the image's Dockerfile adds, e.g. user 1000's home and
  /var/lib/horizon-ray, is created in that layer); other host mounts the image needs (the checkout and its
  virtual environment, when they are on mounts of their own) are bound read-only;
- a fresh /proc of the container's PID namespace, the host's /dev and /sys, a private /tmp and /dev/shm (the
  checkout and interpreter bound back into it, read-only, when the host keeps them under /tmp);
- every volumeMount of the pod spec bound at its mountPath (read-only where the spec says so), and the
  pod's /etc/hosts (the kubelet writes one per pod). A path the pod spec does not mount does not exist;
- the pod's securityContext (runAsUser, runAsGroup, fsGroup as a supplementary group), no new privileges.

SPEC.json: {"scratch": dir, "binds": [[source, target, read_only], ...], "readonly_host_mounts": [...],
"image_dirs": [[path, uid, gid, mode], ...], "readable": [path, ...], "passwd": line, "hosts": file,
"uid", "gid", "groups", "env": {...}, "argv": [...], "cwd": dir, "shm_bytes": n}.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
PR_SET_NO_NEW_PRIVS = 38


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def bind(source: str, target: Path, read_only: bool) -> None:
    if Path(source).is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(exist_ok=True)
    mount("--rbind", source, str(target))
    if read_only:
        mount("-o", "remount,bind,ro", str(target))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    scratch = Path(spec["scratch"])
    upper, work, root = scratch / "upper", scratch / "work", scratch / "root"
    for d in (upper, work, root, scratch / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    # the image: the host's root file system, read-only below a private writable layer (kept on disk for a
    # post-mortem; on a kernel that refuses an upper layer inside the lower one, in memory)
    layers = f"lowerdir=/,upperdir={upper},workdir={work}"
    if subprocess.run(["mount", "-t", "overlay", "overlay", "-o", layers, str(root)]).returncode != 0:
        mem = scratch / "layer"
        mem.mkdir(exist_ok=True)
        mount("-t", "tmpfs", "layer", str(mem))
        (mem / "upper").mkdir()
        (mem / "work").mkdir()
        mount("-t", "overlay", "overlay", "-o", f"lowerdir=/,upperdir={mem / 'upper'},workdir={mem / 'work'}",
              str(root))
    for host_mount in spec["readonly_host_mounts"]:
        bind(host_mount, root / host_mount.lstrip("/"), read_only=True)
    mount("-t", "proc", "proc", str(root / "proc"))  # this PID namespace's processes only
    mount("--rbind", "/dev", str(root / "dev"))
    mount("--rbind", "/sys", str(root / "sys"))
    mount("-t", "tmpfs", "-o", f"size={spec['shm_bytes']}", "shm", str(root / "dev" / "shm"))
    bind(str(scratch / "tmp"), root / "tmp", read_only=False)
    os.chmod(root / "tmp", 0o1777)
    # what the image's Dockerfile creates
    for path, uid, gid, mode in spec["image_dirs"]:
        d = root / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, uid, gid)
        os.chmod(d, mode)
    # the image's interpreter and project are readable by the container's user (the host may keep them under
    # a private home: the container's copy of the folders above them opens for traversal)
    for path in spec["readable"]:
        for d in [Path(path), *Path(path).parents]:
            inside = root / str(d).lstrip("/")
            if inside.is_dir() and inside.stat().st_mode & 0o005 != 0o005:
                os.chmod(inside, inside.stat().st_mode | 0o005)
    passwd = root / "etc" / "passwd"
    text = passwd.read_text()
    if spec["passwd"].split(":")[0] + ":" not in text:
        passwd.write_text(text.rstrip("\n") + "\n" + spec["passwd"] + "\n")
    # the pod's volumes, then its hosts file
    for source, target, read_only in spec["binds"]:
        bind(source, root / target.lstrip("/"), read_only)
    # a checkout or interpreter that lives under the host's /tmp (a CI clone there) stays visible through the
    # private /tmp, read-only, as the image would carry it: after the pod's volumes, one of which may be mounted
    # on /tmp itself (the api pod's emptyDir) and would hide it
    under_tmp = sorted({p for p in spec["readable"] if p.startswith("/tmp/")})
    for p in under_tmp:
        if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in under_tmp) and os.path.exists(p):
            bind(p, root / p.lstrip("/"), read_only=True)
    bind(spec["hosts"], root / "etc" / "hosts", read_only=True)

    os.chroot(root)
    os.chdir(spec["cwd"] if os.path.isdir(spec["cwd"]) else "/")
    # a container runtime's open-files limit (as high as this machine allows), before the privileges to raise
    # it are dropped
    hard = min(1048576, int(Path("/proc/sys/fs/nr_open").read_text()))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(65536, hard), hard))
    except ValueError:
        pass  # kept as inherited
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # allowPrivilegeEscalation: false
    env = spec["env"]
    argv = spec["argv"]
    exe = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
    if exe is None:
        print(f"podsim: {argv[0]!r} not found on PATH={env.get('PATH')}", file=sys.stderr)
        os._exit(127)
    os.execve(exe, argv, env)


if __name__ == "__main__":
    main(sys.argv[1])
