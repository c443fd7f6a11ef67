"""`horizon-ray serve` as a user starts it, in its own process group, for the integration tests that drive it
from outside (REST, the OpenAI SDK, `ray job submit`, the README's commands). Always stopped, however the
test ends."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _ephemeral_low() -> int:
    """The first port of the range the kernel picks from for bind(0) and for outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


RAY_WORKER_PORTS_END = 19999  # Ray's workers bind ports 10002-19999 by number (ray start --max-worker-port)
_handed_out: set[int] = set()  # ports free_port gave this process: never the same one twice
_draw = random.SystemRandom()  # not the seeded module generator: every test process must draw its own ports


def free_port() -> int:
    """A free port on 127.0.0.1 for a server another process starts that can only be told its number (Ray's
    GCS and dashboard; serve's API takes --port 0 and prints the port it bound): the port must be released
    before that process binds it. A port of the kernel's ephemeral range (what bind(0) returns) may be given in
    that window to any of the machine's outgoing connections (Ray opens many) or to another bind(0); so the
    port is drawn at random between Ray's worker ports and that range, where only a process asking for that
    very number can take it, and checked free."""
    first, low = RAY_WORKER_PORTS_END + 1, _ephemeral_low()
    if low - first < 1000:
        raise AssertionError(f"the kernel's ephemeral ports start at {low}: no room for the tests' ports above "
                             f"Ray's worker ports (to {RAY_WORKER_PORTS_END})")
    for _ in range(200):
        port = _draw.randrange(first, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise AssertionError(f"no free port in {first}-{low - 1} after 200 tries")


@dataclass
class Served:
    proc: subprocess.Popen  # serve (or the shell running it), the leader of its own process group
    url: str | None  # the base URL of the API, from serve's "API on http://" line (None: serve runs no API)
    log: Path  # serve's stdout and stderr


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """The shell of a user who ran `source .venv/bin/activate` (the README's first line), with
    $HORIZON_RAY_HOME at `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORIZON_", "RAY_ADDRESS"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(BIN.parent),
               HORIZON_RAY_HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", OMP_NUM_THREADS="1", **extra)
    return env


@contextlib.contextmanager
def serving(argv: list[str], env: dict[str, str], log: Path, *, cwd: Path = ROOT, ready: str = "API on http://",
            timeout_s: float = 300) -> Iterator[Served]:
    """`argv` (a `horizon-ray serve` command, or a shell running one) until its log shows `ready` and the API
    it names takes connections; SIGINT (Ctrl-C) to its process group on the way out, then SIGKILL of what
    lingers. Give serve `--port 0`: it binds a port the OS picks and prints it, which is read back here (a port
    picked free beforehand may be taken by another process before serve binds it)."""
    # Ray's temp dir, of this cluster alone: a command given no address (`ray job submit`, as the README writes
    # it) finds the cluster named in <RAY_TMPDIR>/ray/ray_current_cluster, which is the newest cluster of the dir.
    # Set in `env` itself, so that the commands the test runs with it beside serve reach this one (short: Ray's
    # socket paths must fit 107 bytes)
    own_tmp = None
    if "RAY_TMPDIR" not in env:
        own_tmp = tempfile.mkdtemp(prefix="hr-serve-", dir="/tmp")
        env["RAY_TMPDIR"] = own_tmp
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s

        def wait(what: str, met: Callable[[], bool]) -> None:
            while not met():
                if proc.poll() is not None:
                    raise AssertionError(f"serve exited {proc.returncode} before {what}:\n{log.read_text()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what}: not within {timeout_s:.0f} s:\n{log.read_text()}")
                time.sleep(0.5)

        wait("it was ready", lambda: ready in log.read_text(errors="replace"))
        api = API_LINE.search(log.read_text(errors="replace"))
        if api:
            wait("its API took connections", lambda: _accepts(api["host"], int(api["port"])))
        yield Served(proc=proc, url=f"http://{api['host']}:{api['port']}" if api else None, log=log)
    finally:
        stop_group(proc)
        if own_tmp is not None:
            env.pop("RAY_TMPDIR", None)
            shutil.rmtree(own_tmp, ignore_errors=True)


API_LINE = re.compile(r"API on http://(?P<host>[^:/\s]+):(?P<port>\d+)")  # serve's line naming its bound port


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


def stop_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Ctrl-C to the process group we started (serve stops its service and its Ray cluster), then SIGKILL
    what is left of the group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
