"""The coordinator's job table on disk (sqlite): jobs, their event logs, checkpoints and scheduler state.

One writer (the coordinator) and one file. Each coordinator change is one transaction, so a coordinator
killed at any point restarts from a consistent table: every non-terminal job is still there.

A job's record is stored as JSON with the version of its layout (`RECORD_SCHEMA`; a record without one was
written by d681f7c or before: version 1). Reading is tolerant both ways, so that a coordinator upgraded or rolled
back loads the table it finds: a field the record lacks takes its default, a field this code does not know is
dropped (and logged once).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

from horizon_ray.cluster.messages import Checkpoint, EventType, JobEvent, JobRecord, JobStatus

log = logging.getLogger("horizon_ray.cluster")
RECORD_SCHEMA = 2  # layout of a stored job record: 1 (no "schema" key) up to d681f7c; 2 adds the key
_FIELDS = frozenset(f.name for f in dataclasses.fields(JobRecord))
_dropped_logged: set[str] = set()  # unknown fields already logged, once per process

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    idempotency_key TEXT,
    metrics_offset INTEGER NOT NULL DEFAULT 0,
    last_seq INTEGER NOT NULL DEFAULT 0,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, created_at);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idem ON jobs (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    time REAL NOT NULL,
    type TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


class JobStore:
    """Durable job table. All methods are thread-safe; `transaction()` groups writes atomically."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self._depth = 0

    # ---- transactions --------------------------------------------------------------------------------

    def transaction(self) -> _Transaction:
        return _Transaction(self)

    def _begin(self) -> None:
        self._lock.acquire()
        if self._depth == 0:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except BaseException:
                self._lock.release()  # a failed BEGIN (database locked) must not keep every other caller out
                raise
        self._depth += 1

    def _end(self, ok: bool) -> None:
        self._depth -= 1
        try:
            if self._depth == 0:
                self._db.execute("COMMIT" if ok else "ROLLBACK")
        finally:
            self._lock.release()

    # ---- jobs ----------------------------------------------------------------------------------------

    def put_job(self, job: JobRecord, *, metrics_offset: int | None = None) -> None:
        with self.transaction():
            self._db.execute(
                "INSERT INTO jobs (id, tenant, status, created_at, idempotency_key, record) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET status=excluded.status, "
                "record=excluded.record",
                (job.id, job.tenant, job.status.value, job.created_at, job.idempotency_key,
                 json.dumps(encode_record(job))),
            )
            if metrics_offset is not None:
                self._db.execute("UPDATE jobs SET metrics_offset=? WHERE id=?", (metrics_offset, job.id))

    def delete_job(self, job_id: str) -> None:
        with self.transaction():
            for table, col in (("jobs", "id"), ("events", "job_id"), ("checkpoints", "job_id")):
                self._db.execute(f"DELETE FROM {table} WHERE {col}=?", (job_id,))

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT record, last_seq FROM jobs WHERE id=?", (job_id,)).fetchone()
        return _record(row) if row else None

    def find_idempotent(self, tenant: str, key: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT record, last_seq FROM jobs WHERE tenant=? AND idempotency_key=?", (tenant, key)
            ).fetchone()
        return _record(row) if row else None

    def jobs(self, *, statuses: tuple[JobStatus, ...] | None = None) -> list[JobRecord]:
        """Jobs in submit order, optionally only those in `statuses`."""
        sql, args = "SELECT record, last_seq FROM jobs", tuple[str, ...]()
        if statuses is not None:
            sql += f" WHERE status IN ({','.join('?' * len(statuses))})"
            args = tuple(s.value for s in statuses)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created_at, id", args).fetchall()
        return [_record(r) for r in rows]

    def list_jobs(
        self, tenant: str, *, limit: int, after: str | None, status: JobStatus | None
    ) -> tuple[list[JobRecord], bool]:
        """A tenant's jobs, newest first, `limit` of them after the job `after`; and whether more follow."""
        sql, args = "SELECT record, last_seq FROM jobs WHERE tenant=?", list[Any]([tenant])
        if status is not None:
            sql += " AND status=?"
            args.append(status.value)
        if after is not None:
            with self._lock:
                row = self._db.execute("SELECT created_at FROM jobs WHERE id=? AND tenant=?",
                                       (after, tenant)).fetchone()
            if row is None:
                return [], False
            sql += " AND (created_at < ? OR (created_at = ? AND id < ?))"
            args += [row[0], row[0], after]
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        args.append(limit + 1)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        jobs = [_record(r) for r in rows]
        return jobs[:limit], len(jobs) > limit

    def metrics_offset(self, job_id: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT metrics_offset FROM jobs WHERE id=?", (job_id,)).fetchone()
        return int(row[0]) if row else 0

    # ---- events and checkpoints ----------------------------------------------------------------------

    def add_event(self, job_id: str, time: float, type: EventType, data: dict[str, Any]) -> JobEvent:
        with self.transaction():
            seq = self._db.execute("SELECT last_seq FROM jobs WHERE id=?", (job_id,)).fetchone()[0] + 1
            self._db.execute("UPDATE jobs SET last_seq=? WHERE id=?", (seq, job_id))
            self._db.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?)",
                             (job_id, seq, time, type.value, json.dumps(data)))
        return JobEvent(seq=seq, job_id=job_id, time=time, type=type, data=data)

    def events(self, job_id: str, after_seq: int = 0, limit: int | None = None) -> list[JobEvent]:
        sql = "SELECT seq, time, type, data FROM events WHERE job_id=? AND seq>? ORDER BY seq"
        args: tuple = (job_id, after_seq)
        if limit is not None:
            sql += " LIMIT ?"
            args += (limit,)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [JobEvent(seq=s, job_id=job_id, time=t, type=EventType(ty), data=json.loads(d))
                for s, t, ty, d in rows]

    def add_checkpoint(self, job_id: str, ckpt: Checkpoint) -> None:
        with self.transaction():
            self._db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?)",
                             (job_id, ckpt.step, ckpt.path, ckpt.time))

    def delete_checkpoints(self, job_id: str, steps: list[int]) -> None:
        """Forget checkpoints the job's runner deleted (it keeps the newest checkpoint.keep)."""
        with self.transaction():
            self._db.executemany("DELETE FROM checkpoints WHERE job_id=? AND step=?",
                                 [(job_id, int(s)) for s in steps])

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        with self._lock:
            rows = self._db.execute(
                "SELECT step, path, time FROM checkpoints WHERE job_id=? ORDER BY step", (job_id,)
            ).fetchall()
        return [Checkpoint(step=s, path=p, time=t) for s, p, t in rows]

    # ---- scheduler state -----------------------------------------------------------------------------

    def get_meta(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_meta(self, key: str, value: Any) -> None:
        with self.transaction():
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def encode_record(job: JobRecord) -> dict[str, Any]:
    """The stored form of a job record: its fields and the schema version."""
    return {"schema": RECORD_SCHEMA, **job.to_dict()}


def decode_record(stored: dict[str, Any]) -> JobRecord:
    """A stored record of any schema version: missing fields take their defaults, unknown ones are dropped."""
    d = {k: v for k, v in stored.items() if k != "schema"}
    unknown = sorted(set(d) - _FIELDS)
    new = sorted(set(unknown) - _dropped_logged)
    if new:
        _dropped_logged.update(new)
        log.warning("job records of schema %s carry fields this coordinator (schema %s) does not know, "
                    "dropped: %s", stored.get("schema", 1), RECORD_SCHEMA, ", ".join(new))
    return JobRecord.from_dict({k: v for k, v in d.items() if k in _FIELDS})


def _record(row: tuple[str, int]) -> JobRecord:
    """A job's record, with the seq of its newest event (kept in its own column by add_event)."""
    job = decode_record(json.loads(row[0]))
    job.last_seq = int(row[1])
    return job


class _Transaction:
    def __init__(self, store: JobStore):
        self._store = store

    def __enter__(self) -> JobStore:
        self._store._begin()
        return self._store

    def __exit__(self, exc_type, exc, tb) -> None:
        self._store._end(exc_type is None)
