"""The coordinator's exit policy and report handling, as the pure functions they are (no coordinator)."""

import signal

import pytest

from horizon_ray import exit_codes
from horizon_ray.cluster.exits import RETRY_AFTER_S, exit_outcome
from horizon_ray.cluster.messages import AgentJobReport, ErrorCode, EventType, ExitInfo, JobRecord, JobStatus
from horizon_ray.cluster.reports import MemoryMark, apply_report
from horizon_ray.job import events as ev

GiB = 2**30


def _exit(code: int, cancelled: bool = False, stderr: str = "") -> ExitInfo:
    return ExitInfo(returncode=code, cancelled=cancelled, peak_rss_bytes=3 * GiB, stderr_tail=stderr, time=0.0)


@pytest.mark.parametrize("code, cancelled, status, want, error", [
    (0, False, JobStatus.RUNNING, JobStatus.SUCCEEDED, None),
    (0, False, JobStatus.CANCELLING, JobStatus.SUCCEEDED, None),  # finished before the cancel reached it
    (-signal.SIGTERM, True, JobStatus.CANCELLING, JobStatus.CANCELLED, None),
    (exit_codes.TERMINATED, False, JobStatus.RUNNING, JobStatus.RECOVERING, None),
    (exit_codes.INTERRUPTED, False, JobStatus.CHECKPOINTING, JobStatus.RECOVERING, None),
    (exit_codes.OUTPUT_DIR_BUSY, False, JobStatus.RUNNING, JobStatus.RECOVERING, None),
    (-signal.SIGKILL, False, JobStatus.RUNNING, JobStatus.FAILED, ErrorCode.OOM_KILLED),
    (-signal.SIGSEGV, False, JobStatus.RUNNING, JobStatus.FAILED, ErrorCode.KILLED),
    (exit_codes.BAD_INPUT, False, JobStatus.RUNNING, JobStatus.FAILED, ErrorCode.BAD_INPUT),
    (exit_codes.CRASHED, False, JobStatus.RUNNING, JobStatus.FAILED, ErrorCode.ENGINE_CRASHED),
])
def test_every_exit_has_one_outcome(code, cancelled, status, want, error):
    out = exit_outcome(_exit(code, cancelled, stderr="Traceback ...\nerror: the job crashed: boom\n"), status,
                       2 * GiB, "a")
    assert (out.status, out.code) == (want, error)
    if want is JobStatus.RECOVERING:
        assert out.retry_after_s == RETRY_AFTER_S
    if error is ErrorCode.OOM_KILLED:
        assert "SIGKILL" in out.reason and "peak RSS 3.0 GiB against 2.0 GiB planned" in out.reason
    if error is ErrorCode.ENGINE_CRASHED:
        assert out.reason == "engine exited with code 1: error: the job crashed: boom"


def _job(status=JobStatus.RUNNING) -> JobRecord:
    return JobRecord(id="job-1", tenant="acme", name=None, status=status, priority=0, created_at=0.0, spec={},
                     plan={"host_bytes": GiB})


def _report(*events, exit=None) -> AgentJobReport:
    return AgentJobReport(job_id="job-1", events=list(events), next_offset=0, rss_bytes=0, peak_rss_bytes=0,
                          exit=exit)


def test_a_report_moves_progress_checkpoints_and_the_log():
    job = _job()
    got = apply_report(job, _report(ev.Start(step=0, total_steps=10), ev.Metrics(step=1, loss=2.0, tokens_per_s=5.0),
                                    ev.Eval(step=1, eval_loss=1.5), ev.CheckpointBegin(step=1),
                                    ev.Checkpoint(step=1, path="/o/checkpoints/step-00000001", pruned=[0]),
                                    ev.Error(step=1, message="stopped by SIGTERM")),
                       now=100.0, mark=MemoryMark(), memory_interval_s=10.0)
    assert (job.progress.step, job.progress.total_steps, job.progress.tokens_per_s) == (1, 10, 5.0)
    assert job.metrics["loss"] == 2.0 and job.metrics["eval_loss"] == 1.5 and job.last_checkpoint_step == 1
    assert [c.step for c in got.checkpoints] == [1] and got.pruned == [0]
    assert [kind for _, kind, _ in got.events] == [EventType.METRICS, EventType.METRICS, EventType.CHECKPOINT,
                                                   EventType.ERROR]
    assert got.move is None  # begun and written within one report: no flapping state


def test_checkpointing_is_the_state_the_report_ends_in():
    running, writing = _job(), _job(JobStatus.CHECKPOINTING)
    mark = MemoryMark()
    assert apply_report(running, _report(ev.CheckpointBegin(step=4)), 1.0, mark, 10.0).move == (
        JobStatus.CHECKPOINTING, "writing a checkpoint")
    assert apply_report(writing, _report(ev.Metrics(step=4, loss=1.0)), 1.0, mark, 10.0).move is None
    assert apply_report(writing, _report(ev.Checkpoint(step=4, path="p")), 1.0, mark, 10.0).move == (
        JobStatus.RUNNING, "checkpoint written")
    # an engine that dies while it writes is not "checkpoint written": the exit decides
    assert apply_report(_job(JobStatus.CHECKPOINTING), _report(exit=_exit(-9)), 1.0, mark, 10.0).move is None
