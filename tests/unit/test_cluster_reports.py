"""The coordinator's exit policy and report handling, as the pure functions they are (no coordinator)."""

import signal

import pytest

from horizon_ray import exit_codes
from horizon_ray.cluster.exits import MAX_RETRY_PAUSE_S, RETRY_AFTER_S, exit_outcome, retry_pause_s
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
    (exit_codes.OUTPUT_DIR_BUSY, False, JobStatus.RUNNING, JobStatus.RECOVERING, ErrorCode.OUTPUT_DIR_BUSY),
    (exit_codes.FENCED, False, JobStatus.RUNNING, JobStatus.RECOVERING, ErrorCode.KILLED),
    (exit_codes.FENCED, False, JobStatus.CANCELLING, JobStatus.CANCELLED, None),
    (-signal.SIGKILL, False, JobStatus.RUNNING, JobStatus.FAILED, ErrorCode.OOM_KILLED),  # past its plan
    (-signal.SIGSEGV, False, JobStatus.RUNNING, JobStatus.RECOVERING, ErrorCode.KILLED),
    (exit_codes.BAD_INPUT, False, JobStatus.RUNNING, JobStatus.FAILED, ErrorCode.BAD_INPUT),
    (exit_codes.CRASHED, False, JobStatus.RUNNING, JobStatus.FAILED, ErrorCode.ENGINE_CRASHED),
])
def test_every_exit_has_one_outcome(code, cancelled, status, want, error):
    out = exit_outcome(_exit(code, cancelled, stderr="Traceback ...\nerror: the job crashed: boom\n"), status,
                       2 * GiB, "a")
    assert (out.status, out.code) == (want, error)
    if want is JobStatus.RECOVERING:
        # a stop from outside pauses; a start that ended without a step counts against the retries
        assert out.retry_after_s == RETRY_AFTER_S if not out.retry else out.retry_after_s == 0.0
        assert out.retry == (error is not None)
    if error is ErrorCode.OOM_KILLED:
        assert "SIGKILL" in out.reason and "it grew to 3.0 GiB, past the 2.0 GiB planned" in out.reason
    if error is ErrorCode.ENGINE_CRASHED:
        assert out.reason == "engine exited with code 1: error: the job crashed: boom"


def _killed(**evidence) -> ExitInfo:
    base = dict(returncode=-signal.SIGKILL, cancelled=False, peak_rss_bytes=1 * GiB, stderr_tail="", time=0.0,
                oom_kills=0, min_available_bytes=40 * GiB, ram_bytes=64 * GiB)
    return ExitInfo(**{**base, **evidence})


def test_a_killed_engine_is_not_an_oom_without_evidence():
    """kill -9 of an engine below its plan on a node with free memory: a crash, resumed from its checkpoint."""
    out = exit_outcome(_killed(), JobStatus.RUNNING, 2 * GiB, "a")
    assert (out.status, out.code, out.retry) == (JobStatus.RECOVERING, ErrorCode.KILLED, True)
    assert "no sign of memory pressure" in out.reason and "out of memory" not in out.reason
    # unknown memory (an agent that could not sample) is no evidence either
    assert exit_outcome(_killed(min_available_bytes=None, ram_bytes=0), JobStatus.RUNNING, 2 * GiB,
                        "a").status is JobStatus.RECOVERING


@pytest.mark.parametrize("evidence, says", [
    ({"oom_kills": 1}, "the kernel counted 1 OOM kill(s) on the node while it ran"),
    ({"peak_rss_bytes": 3 * GiB}, "it grew to 3.0 GiB, past the 2.0 GiB planned"),
    ({"min_available_bytes": 100 * 2**20}, "the node had only 100.0 MiB of memory available"),
    ({"min_available_bytes": GiB, "ram_bytes": 64 * GiB}, "the node had only 1.0 GiB of memory available"),
])
def test_a_killed_engine_is_an_oom_on_evidence(evidence, says):
    out = exit_outcome(_killed(**evidence), JobStatus.RUNNING, 2 * GiB, "a")
    assert (out.status, out.code) == (JobStatus.FAILED, ErrorCode.OOM_KILLED)
    assert out.reason == f"engine killed by SIGKILL, out of memory: {says}"


def test_retries_pause_longer_each_time_up_to_a_cap():
    assert [retry_pause_s(n) for n in (1, 2, 3, 4)] == [RETRY_AFTER_S, 2 * RETRY_AFTER_S, 4 * RETRY_AFTER_S,
                                                        8 * RETRY_AFTER_S]
    assert retry_pause_s(50) == MAX_RETRY_PAUSE_S


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
