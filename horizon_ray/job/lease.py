"""The lease on a job's output directory: which start of the job's engine may write there.

The coordinator numbers the starts of a job's engine (its epoch: `Launch.attempt`, 1, 2, ...). The node
agent that starts one records its epoch in ``<output_dir>/.lease`` (`grant`) before the engine runs; the
coordinator revokes the lease when the job is cancelled or its node is lost (`revoke`). The engine holds a
`Fence` and reads the lease before each step and around everything it commits (a metrics line, a checkpoint,
the final model, DONE): once the lease names a newer epoch (its job was recovered elsewhere while it was cut
off) or is revoked, it stops at once (`Fenced`) and writes nothing more.

A check and the write it guards hold an flock on ``<output_dir>/.lease.lock`` shared; `grant` and `revoke`
hold it exclusively. So when `grant` or `revoke` returns, no engine of an older epoch is inside a guarded
write, and none starts one: a cancel that has returned has stopped every write of the job. (A checkpoint or a
final model being written goes to a temporary directory first; only its rename into place is a commit.)

The lease lives on the storage every node sees, like the outputs it guards: an engine cut off from the
coordinator still sees it, and an engine that cannot see it cannot write its outputs either.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from horizon_ray.atomic import write_atomic

LEASE_FILE = ".lease"
LOCK_FILE = ".lease.lock"
ENV_EPOCH = "HORIZON_RAY_LEASE_EPOCH"  # the epoch the node agent started the engine with
ENV_JOB = "HORIZON_RAY_JOB_ID"  # the job the engine runs
_LOCK_WAIT_S = 10.0  # how long grant/revoke wait for guarded writes in flight (each takes milliseconds)


@dataclass(frozen=True)
class Lease:
    """The content of ``<output_dir>/.lease``."""

    job_id: str  # the job whose engines may write here
    epoch: int  # the start of its engine that may write (1, 2, ...)
    revoked: bool = False  # no start of this job may write any more (cancelled, or its node was lost)
    node_id: str | None = None  # the node the epoch was granted to
    time: float = 0.0  # when it was written (unix seconds)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode() + b"\n"

    @staticmethod
    def decode(data: bytes) -> Lease:
        d = json.loads(data)
        return Lease(job_id=str(d["job_id"]), epoch=int(d["epoch"]), revoked=bool(d.get("revoked")),
                     node_id=d.get("node_id"), time=float(d.get("time") or 0.0))


class Fenced(BaseException):
    """Raised in an engine whose lease moved on. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it: the engine must stop, not carry on writing."""


class LeaseLost(Exception):
    """`grant` found the lease taken by a newer start of the job, or revoked for this one."""


def read_lease(output_dir: str | os.PathLike) -> Lease | None:
    """The lease of an output directory, or None when none was granted (or its file is unreadable)."""
    try:
        return Lease.decode(Path(output_dir, LEASE_FILE).read_bytes())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def grant(output_dir: str | os.PathLike, job_id: str, epoch: int, node_id: str | None = None) -> Lease:
    """Give the lease to start `epoch` of `job_id`; LeaseLost when a newer start holds it (or this one was
    revoked). When it returns, no engine of an older epoch of the job writes here any more."""
    out = Path(output_dir)
    with _exclusive(out):
        held = read_lease(out)
        if held is not None and held.job_id == job_id and (
                held.epoch > epoch or (held.epoch == epoch and held.revoked)):
            raise LeaseLost(f"the lease of job {job_id} on {out} is at epoch {held.epoch}"
                            + (" (revoked)" if held.revoked else "") + f"; start {epoch} is stale")
        lease = Lease(job_id=job_id, epoch=epoch, node_id=node_id, time=time.time())
        write_atomic(out / LEASE_FILE, lease.encode())
        return lease


def revoke(output_dir: str | os.PathLike, job_id: str, epoch: int | None = None) -> Lease | None:
    """Revoke `job_id`'s lease: no engine of it (of `epoch` or older, when given) writes here once this returns.
    None when there is nothing to revoke (no lease, another job's, or a newer epoch's)."""
    out = Path(output_dir)
    if not out.is_dir():
        return None
    with _exclusive(out):
        held = read_lease(out)
        if held is None or held.job_id != job_id or held.revoked or (epoch is not None and held.epoch > epoch):
            return None
        lease = Lease(job_id=job_id, epoch=held.epoch, revoked=True, node_id=held.node_id, time=time.time())
        write_atomic(out / LEASE_FILE, lease.encode())
        return lease


class Fence:
    """An engine's side of the lease: start `epoch` of `job_id` writing in `output_dir`."""

    def __init__(self, output_dir: str | os.PathLike, job_id: str, epoch: int):
        self.output_dir = Path(output_dir)
        self.job_id = job_id
        self.epoch = epoch

    @staticmethod
    def from_env(output_dir: str | os.PathLike, environ: dict[str, str] | None = None) -> Fence | None:
        """The fence of an engine the node agent started (it sets the epoch and the job), else None: a job run
        by hand is guarded by the output directory's flock alone."""
        env = os.environ if environ is None else environ
        epoch, job = env.get(ENV_EPOCH), env.get(ENV_JOB)
        if not epoch or not job:
            return None
        return Fence(output_dir, job, int(epoch))

    def check(self, what: str) -> None:
        """Raise Fenced when this engine may no longer write (`what`: what it was about to do)."""
        held = read_lease(self.output_dir)
        if held is None or held.job_id != self.job_id:
            raise Fenced(f"stopped before {what}: the lease on {self.output_dir} is gone or another job's; "
                         "this engine writes nothing more")
        if held.epoch != self.epoch:
            raise Fenced(f"stopped before {what}: start {held.epoch} of the job took over its output directory "
                         f"(this engine is start {self.epoch}); it writes nothing more")
        if held.revoked:
            raise Fenced(f"stopped before {what}: the job's lease was revoked (cancelled, or its node was "
                         "declared lost); this engine writes nothing more")

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Check the lease and hold it for the write in the block: grant and revoke wait for the block to end."""
        fd = _lock_fd(self.output_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            self.check(what)
            yield
        finally:
            os.close(fd)  # releases the lock


def _lock_fd(out: Path) -> int:
    return os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)


@contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    out.mkdir(parents=True, exist_ok=True)
    fd = _lock_fd(out)
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    # A guarded write held for this long belongs to a stopped (frozen) engine: write anyway; it
                    # reads the lease again before its next write.
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)
