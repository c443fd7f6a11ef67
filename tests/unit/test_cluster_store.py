"""The job table across versions: records carry their schema version, and a table written by an older
coordinator (d681f7c, from tests/data) or a newer one loads."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from horizon_ray.cluster.coordinator import Coordinator
from horizon_ray.cluster.fake import FakeAgent, size_planner
from horizon_ray.cluster.messages import EventType, JobStatus
from horizon_ray.cluster.store import RECORD_SCHEMA, JobStore

OLD_TABLE = Path(__file__).resolve().parents[1] / "data" / "job-table-d681f7c.sql"


def old_table(tmp_path: Path) -> Path:
    """The job table main at d681f7c wrote (`iterdump` of it): a succeeded, a running, a two-GPU, a queued and
    a cancelled job, with events and checkpoints; its output dirs moved under `tmp_path`."""
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path)
    db.executescript(OLD_TABLE.read_text().replace("@JOBS_ROOT@", str(tmp_path / "jobs")))
    db.close()
    return path


def test_a_table_written_by_d681f7c_loads_and_its_jobs_go_on(tmp_path):
    path = old_table(tmp_path)
    assert all("schema" not in json.loads(r) for (r,) in sqlite3.connect(path).execute("SELECT record FROM jobs"))
    agents = {"a": FakeAgent("a", "16GiB", auto=False), "b": FakeAgent("b", "64GiB", gpu_count=2, auto=False)}
    core = Coordinator(store_path=path, jobs_root=tmp_path / "jobs", agents=agents, planner=size_planner)
    try:
        jobs = {j.name: j for j in core.store.jobs()}
        assert {n: j.status for n, j in jobs.items()} == {
            "finished": JobStatus.SUCCEEDED, "running": JobStatus.RUNNING, "gpu": JobStatus.RUNNING,
            "queued": JobStatus.QUEUED, "cancelled": JobStatus.CANCELLED}
        done, running, gpu = jobs["finished"], jobs["running"], jobs["gpu"]
        assert (done.progress.step, done.last_checkpoint_step, done.idempotency_key) == (2, 2, "k1")
        assert [c.step for c in core.checkpoints("acme", done.id)] == [1, 2]
        assert (running.progress.step, running.last_checkpoint_step, running.node_id) == (3, 2, "a")
        assert (gpu.tenant, gpu.node_id, gpu.gpus_held) == ("globex", "b", [0, 1])
        listed, more = core.list("acme")
        assert [j.name for j in listed] == ["cancelled", "queued", "running", "finished"] and not more
        seq = running.last_seq
        assert seq > 0 and core.events("acme", running.id)[-1].seq == seq
        # the new agents never heard of its engine: it is recovered, and its new events follow the old ones
        core.tick()
        running = core.get("acme", running.id)
        assert running.status is JobStatus.RUNNING and running.attempts == 2
        events = core.events("acme", running.id, after_seq=seq)
        assert events[0].seq == seq + 1 and events[0].type is EventType.STATUS
        assert [e.data["to"] for e in events if e.type is EventType.STATUS] == ["recovering", "running"]
        # what is written now carries the schema version; the rest of the table is left as it was
        stored = dict(core.store._db.execute("SELECT id, record FROM jobs").fetchall())
        assert json.loads(stored[running.id])["schema"] == RECORD_SCHEMA
        assert "schema" not in json.loads(stored[done.id])
    finally:
        core.close()


def test_a_record_of_another_version_loads_its_known_fields(tmp_path, caplog):
    path = old_table(tmp_path)
    db = sqlite3.connect(path)
    (job_id, raw), = db.execute("SELECT id, record FROM jobs WHERE status='queued'").fetchall()
    record = json.loads(raw)
    del record["retries"], record["gpu_indices"]  # fields an older layout did not have
    newer = {**record, "schema": RECORD_SCHEMA + 1, "placement_group": "pg-7"}  # one a newer layout added
    db.execute("UPDATE jobs SET record=? WHERE id=?", (json.dumps(newer), job_id))
    db.commit()
    db.close()
    store = JobStore(path)
    try:
        with caplog.at_level("WARNING", logger="horizon_ray.cluster"):
            job = store.get_job(job_id)
            store.get_job(job_id)
        assert (job.name, job.status, job.retries, job.gpu_indices) == ("queued", JobStatus.QUEUED, 0, [])
        assert [r.getMessage() for r in caplog.records if "placement_group" in r.getMessage()] == [
            f"job records of schema {RECORD_SCHEMA + 1} carry fields this coordinator (schema {RECORD_SCHEMA}) "
            "does not know, dropped: placement_group"]  # once, not on every read
    finally:
        store.close()
