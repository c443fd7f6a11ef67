"""The node agent's supervision of real child processes, with a stand-in engine (no Ray, no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from horizon_ray.cluster.agent import NodeAgent, read_new_events
from horizon_ray.cluster.agent_protocol import ReservationRefused
from horizon_ray.cluster.local import wait_for
from horizon_ray.cluster.messages import Launch
from horizon_ray.job import events

GiB = 2**30

# Stands in for `python -m horizon_ray.job --config spec.yaml --resume`: behaviour from spec["stand_in"].
STAND_IN = textwrap.dedent("""
    import os, sys, time, yaml
    from horizon_ray.job import events as ev
    spec = yaml.safe_load(open(sys.argv[sys.argv.index("--config") + 1]))
    assert "--resume" in sys.argv
    cfg = spec["stand_in"]
    out = spec["output_dir"]
    ballast = bytearray(cfg.get("alloc_mb", 0) * 2**20)
    for i in range(len(ballast) // 4096):
        ballast[i * 4096] = 1
    def line(event):
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(ev.encode(event))
    line(ev.Start(step=0, total_steps=cfg["steps"]))
    for step in range(1, cfg["steps"] + 1):
        time.sleep(cfg.get("sleep", 0.0))
        line(ev.Metrics(step=step, loss=1.0 / step, total_steps=cfg["steps"]))
    if cfg.get("checkpoint_hold"):
        line(ev.CheckpointBegin(step=1))
        while not os.path.exists(os.path.join(out, "release")):
            time.sleep(0.05)
        line(ev.Checkpoint(step=1, path=os.path.join(out, "checkpoints", "step-00000001")))
    if cfg.get("leave_child"):  # a helper it started that ignores SIGTERM, still running when it exits
        import subprocess
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        helper = subprocess.Popen([sys.executable, "-c", code])
        with open(os.path.join(out, "helper.pid"), "w") as f:
            f.write(str(helper.pid))
    if cfg.get("hang"):
        time.sleep(600)
    if cfg.get("exit", 0):
        print("Traceback ...", file=sys.stderr)
        print("error: the job crashed: RuntimeError: boom", file=sys.stderr)
    sys.exit(cfg.get("exit", 0))
""")


@pytest.fixture
def agent(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    a = NodeAgent("n1", ram_bytes=16 * GiB, gpu_count=0, command=[sys.executable, str(script)],
                  sample_interval_s=0.05, kill_grace_s=2.0)
    yield a
    a.shutdown()


def wait_exit(agent, job_id, timeout=30.0):
    deadline = time.time() + timeout
    offset, lines = 0, []
    while time.time() < deadline:
        report = agent.poll({job_id: offset})[job_id]
        lines += report.events
        offset = report.next_offset
        if report.exit is not None:
            return report, lines
        time.sleep(0.05)
    raise AssertionError(f"{job_id} did not exit")


def wait_running(agent, job_id, rss_bytes=0, timeout=30.0):
    """Until the stand-in has written its Start line (its ballast is allocated by then) and the agent has sampled
    at least `rss_bytes` of it: a signal sent after this finds a running engine, never one still starting."""
    seen = []

    def up():
        report = agent.poll({job_id: 0})[job_id]
        seen[:] = report.events
        return any(isinstance(e, events.Start) for e in seen) and report.peak_rss_bytes > rss_bytes

    wait_for(up, timeout, interval_s=0.05, what=f"{job_id} to run")


def start(agent, tmp_path, job_id, host=GiB, **cfg):
    out = tmp_path / job_id
    agent.start(Launch(job_id=job_id, tenant="acme", spec={"stand_in": {"steps": 3, **cfg}}, output_dir=str(out),
                       host_bytes=host, gpu_bytes=0))
    return out


def test_job_runs_to_the_end_and_its_reservation_is_freed(agent, tmp_path):
    out = start(agent, tmp_path, "j1", host=4 * GiB, alloc_mb=64, sleep=0.2)
    info = agent.info()
    assert info.reserved_bytes == 4 * GiB and [r.job_id for r in info.ledger] == ["j1"]
    report, lines = wait_exit(agent, "j1")
    assert report.exit.returncode == 0 and not report.exit.cancelled
    assert [type(e) for e in lines] == [events.Start, events.Metrics, events.Metrics, events.Metrics]
    assert report.peak_rss_bytes > 64 * 2**20
    assert agent.info().reserved_bytes == 0
    assert (out / "job.yaml").is_file() and list((out / "logs").iterdir())
    agent.forget("j1")
    assert agent.poll({}) == {}


def test_crash_reports_exit_code_and_stderr(agent, tmp_path):
    start(agent, tmp_path, "j2", exit=1)
    report, _ = wait_exit(agent, "j2")
    assert report.exit.returncode == 1
    assert "RuntimeError: boom" in report.exit.stderr_tail
    assert agent.info().reserved_bytes == 0


def test_cancel_stops_the_process_group_and_sigkill_is_seen(agent, tmp_path):
    start(agent, tmp_path, "j3", hang=True)
    wait_running(agent, "j3")
    agent.cancel("j3")
    report, _ = wait_exit(agent, "j3")
    assert report.exit.returncode == -signal.SIGTERM and report.exit.cancelled

    start(agent, tmp_path, "j4", hang=True, alloc_mb=32)
    wait_running(agent, "j4", rss_bytes=32 * 2**20)
    pid = agent._jobs["j4"].proc.pid
    os.kill(pid, signal.SIGKILL)  # what the kernel's OOM killer does
    report, _ = wait_exit(agent, "j4")
    assert report.exit.returncode == -signal.SIGKILL and not report.exit.cancelled
    assert report.exit.peak_rss_bytes > 32 * 2**20
    assert agent.info().reserved_bytes == 0


def test_checkpoint_in_progress_is_reported(agent, tmp_path):
    out = start(agent, tmp_path, "j5", steps=1, checkpoint_hold=True)
    deadline = time.time() + 20
    while not isinstance((agent.poll({})["j5"].events or [None])[-1], events.CheckpointBegin):
        assert time.time() < deadline
        time.sleep(0.05)
    (out / "release").write_text("")
    report, lines = wait_exit(agent, "j5")
    assert isinstance(lines[-1], events.Checkpoint) and lines[-1].step == 1


def test_ledger_refuses_what_does_not_fit_and_forget_kills(agent, tmp_path):
    start(agent, tmp_path, "j6", host=10 * GiB, hang=True)
    with pytest.raises(ReservationRefused):
        start(agent, tmp_path, "j7", host=10 * GiB)
    proc = agent._jobs["j6"].proc
    agent.forget("j6")  # kills it and returns at once; the reservation is held until it is reaped
    assert agent.poll({}) == {}  # a forgotten job is no longer reported
    deadline = time.time() + 20
    while agent.info().reserved_bytes:
        assert time.time() < deadline, "the forgotten job was never reaped"
        time.sleep(0.05)
    assert proc.poll() is not None and "j6" not in agent._jobs


def test_nothing_the_engine_started_outlives_it(agent, tmp_path):
    out = start(agent, tmp_path, "j8", steps=1, leave_child=True)
    report, _ = wait_exit(agent, "j8")
    assert report.exit.returncode == 0 and not report.exit.cancelled
    try:
        helper = psutil.Process(int((out / "helper.pid").read_text()))
    except psutil.NoSuchProcess:
        return  # killed and already reaped (an init that reaps orphans)
    deadline = time.time() + 10
    while _alive(helper):
        assert time.time() < deadline, "the engine's helper outlived it (and its reservation)"
        time.sleep(0.05)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_cancel_after_a_clean_exit_is_not_a_cancel(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    # no monitor pass in the window: the exit is seen first by the cancel itself
    agent = NodeAgent("n1", ram_bytes=16 * GiB, gpu_count=0, command=[sys.executable, str(script)],
                      sample_interval_s=600, kill_grace_s=2.0)
    start(agent, tmp_path, "j9", steps=1)
    proc = agent._jobs["j9"].proc
    proc_deadline = time.time() + 20
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:  # exited 0, not reaped yet
        assert time.time() < proc_deadline
        time.sleep(0.01)
    agent.cancel("j9")
    report, _ = wait_exit(agent, "j9")
    assert report.exit.returncode == 0 and not report.exit.cancelled
    agent.shutdown()


def test_metrics_reader_skips_torn_and_garbage_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "metrics", "step": 1, "loss": 2.0}\n{"type": "met{"type": "start"}\n'
                    '{"type": "metrics", "st')
    lines, offset = read_new_events(path, 0)
    assert [(e.step, e.loss) for e in lines] == [(1, 2.0)]
    with open(path, "a") as f:
        f.write('ep": 2, "loss": 1.0}\n')
    more, offset2 = read_new_events(path, offset)
    assert [(e.step, e.loss) for e in more] == [(2, 1.0)] and offset2 == path.stat().st_size
    path.write_text('{"type": "start", "step": 0, "total_steps": 3}\n')  # rewritten: shorter than the offset
    assert [(type(e), e.total_steps) for e in read_new_events(path, offset2)[0]] == [(events.Start, 3)]


def test_engine_dies_with_its_agent(tmp_path):
    """A job's engine never outlives its agent (no stale twin after recovery elsewhere)."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    driver = textwrap.dedent(f"""
        import sys, time
        from horizon_ray.cluster.agent import NodeAgent
        a = NodeAgent("n", ram_bytes=2**30, gpu_count=0, command=[sys.executable, {str(script)!r}])
        from horizon_ray.cluster.messages import Launch
        a.start(Launch(job_id="j", tenant="acme", spec={{"stand_in": {{"steps": 1, "hang": True}}}},
                       output_dir={str(tmp_path / "j")!r}, host_bytes=1, gpu_bytes=0))
        print(a._jobs["j"].proc.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(proc.stdout.readline()))
        deadline = time.time() + 20
        while not (tmp_path / "j" / "metrics.jsonl").exists():  # the engine is up and writing
            assert time.time() < deadline
            time.sleep(0.05)
        assert child.is_running()
        proc.kill()
        proc.wait()
        child.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not child.is_running()


def test_spec_written_for_the_engine_has_the_output_dir(agent, tmp_path):
    import yaml

    out = start(agent, tmp_path, "j8", steps=1)
    wait_exit(agent, "j8")
    written = yaml.safe_load((out / "job.yaml").read_text())
    assert written["output_dir"] == str(out) and Path(written["output_dir"]).is_dir()


@pytest.mark.slow
def test_drain_checkpoints_each_engine_at_its_step_and_stops_it_resumably(tmp_path):
    """What a worker pod's preStop hook does (`horizon-ray drain`): the real engine writes a checkpoint of the
    step it is in, although no periodic checkpoint is due, and exits 143; the node takes no new job."""
    import yaml

    from horizon_ray.job.demo import prepare_demo_assets

    demo, _ = prepare_demo_assets(tmp_path / "home")
    spec = {"model": {"path": str(demo.model_dir)},
            "data": {"path": str(demo.train_path), "format": "messages", "eval_fraction": 0.0},
            "training": {"max_steps": 500, "micro_batch_size": 2, "seq_len": 64, "schedule": {"type": "constant"}},
            "checkpoint": {"every_steps": 1000, "keep": 1}, "engine": {"device": "cpu"}}
    agent = NodeAgent("n1", ram_bytes=16 * GiB, gpu_count=0, cpu_count=1, sample_interval_s=0.05,
                      kill_grace_s=30.0)
    try:
        out = tmp_path / "job"
        agent.start(Launch(job_id="j1", tenant="acme", spec=spec, output_dir=str(out), host_bytes=GiB, gpu_bytes=0))
        assert agent.drain() == ["j1"]  # while it still starts: the signal stays pending until its handler is in
        with pytest.raises(ReservationRefused, match="draining"):
            agent.start(Launch(job_id="j2", tenant="acme", spec=spec, output_dir=str(tmp_path / "job2"),
                               host_bytes=GiB, gpu_bytes=0))
        report, lines = wait_exit(agent, "j1", timeout=240)
        steps = [e.step for e in lines if isinstance(e, events.Metrics)]
        assert report.exit.returncode == 143 and not report.exit.cancelled, report.exit.stderr_tail
        assert steps and steps[-1] < 500
        ckpt = [e for e in lines if isinstance(e, events.Checkpoint)]
        assert [c.step for c in ckpt] == [steps[-1]], lines[-3:]
        assert (out / "checkpoints" / Path(ckpt[0].path).name).is_dir()
        assert isinstance(lines[-1], events.Error) and "drain" in lines[-1].message, lines[-1]
        assert agent.running() == []
        assert yaml.safe_load((out / "job.yaml").read_text())["output_dir"] == str(out)
    finally:
        agent.shutdown()


def test_an_agent_the_coordinator_stopped_calling_stops_its_engines(tmp_path):
    """Its raylet killed, an agent lives on re-parented; with no call from the coordinator for `lease_s` it
    stops its engines (the coordinator recovers their jobs elsewhere once that time has passed)."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    agent = NodeAgent("n1", ram_bytes=16 * GiB, gpu_count=0, command=[sys.executable, str(script)],
                      sample_interval_s=0.05, kill_grace_s=1.0, lease_s=4.0)
    try:
        assert agent.info().engine_lease_s == 5.0  # lease and kill grace: what the coordinator waits for
        start(agent, tmp_path, "polled", hang=True)
        start(agent, tmp_path, "cut-off", hang=True)
        procs = {j: psutil.Process(agent._jobs[j].proc.pid) for j in ("polled", "cut-off")}
        for _ in range(60):  # the coordinator calls for 6 s: past the lease, nothing stops (4 s between two
            # calls would be a stall of this thread the lease is there to catch)
            last_call = time.monotonic()  # taken before the call: the agent hears it at this time or later
            agent.poll({})
            time.sleep(0.1)
        assert all(_alive(p) for p in procs.values())
        deadline = time.monotonic() + 20
        while any(job.exit is None for job in agent._jobs.values()):  # no call any more: both are stopped
            assert time.monotonic() < deadline, "the engines outlived the agent's lease"
            time.sleep(0.05)
        assert time.monotonic() - last_call >= 4.0  # not before the lease ran out, however slow the box
        reports = agent.poll({})
        assert {j: r.exit.returncode for j, r in reports.items()} == {"polled": -signal.SIGTERM,
                                                                      "cut-off": -signal.SIGTERM}
        assert not any(r.exit.cancelled for r in reports.values())  # stopped, not cancelled: they resume
    finally:
        agent.shutdown()


def test_the_start_holds_the_lease_and_a_cancel_revokes_it_before_it_returns(agent, tmp_path):
    from horizon_ray.job import lease

    out = tmp_path / "j10"
    agent.start(Launch(job_id="j10", tenant="acme", spec={"stand_in": {"steps": 1, "hang": True}},
                       output_dir=str(out), host_bytes=GiB, gpu_bytes=0, attempt=3))
    held = lease.read_lease(out)
    assert (held.job_id, held.epoch, held.revoked, held.node_id) == ("j10", 3, False, "n1")
    env = (Path("/proc") / str(agent._jobs["j10"].proc.pid) / "environ").read_bytes().split(b"\0")
    assert f"{lease.ENV_EPOCH}=3".encode() in env and f"{lease.ENV_JOB}=j10".encode() in env
    agent.cancel("j10")
    assert lease.read_lease(out).revoked  # before the engine has even exited
    wait_exit(agent, "j10")


def test_engines_get_none_of_the_api_variables(tmp_path, monkeypatch):
    """The tenants' keys (and the path of their file) stay in the API: read from a running engine's environ."""
    monkeypatch.setenv("HORIZON_API_KEYS", "sk-tenant-secret=acme")
    monkeypatch.setenv("HORIZON_API_KEYS_FILE", "/etc/horizon/keys.yaml")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    agent = NodeAgent("n1", ram_bytes=16 * GiB, gpu_count=0, command=[sys.executable, str(script)],
                      env={"HORIZON_API_MAX_BODY_BYTES": "1", "OMP_NUM_THREADS": "1"}, sample_interval_s=0.05)
    try:
        start(agent, tmp_path, "j11", hang=True)
        environ = (Path("/proc") / str(agent._jobs["j11"].proc.pid) / "environ").read_bytes()
        assert b"HORIZON_API_" not in environ and b"sk-tenant-secret" not in environ and b"keys.yaml" not in environ
        assert b"OMP_NUM_THREADS=1" in environ  # the rest of the agent's environment is passed on
        assert not any(k.startswith("HORIZON_API_") for k in os.environ)  # a Ray worker's own copy is gone too
    finally:
        agent.shutdown()


def test_a_killed_engine_reports_the_evidence_of_memory_pressure(agent, tmp_path):
    start(agent, tmp_path, "j12", hang=True, alloc_mb=16)
    wait_running(agent, "j12", rss_bytes=16 * 2**20)
    os.kill(agent._jobs["j12"].proc.pid, signal.SIGKILL)  # kill -9 from outside, on a node with free memory
    report, _ = wait_exit(agent, "j12")
    ex = report.exit
    assert ex.returncode == -signal.SIGKILL and ex.oom_kills == 0 and ex.ram_bytes == 16 * GiB
    assert ex.min_available_bytes is not None and ex.min_available_bytes > 256 * 2**20
    from horizon_ray.cluster.exits import exit_outcome
    from horizon_ray.cluster.messages import JobStatus

    assert exit_outcome(ex, JobStatus.RUNNING, GiB, "n1").status is JobStatus.RECOVERING


def test_oom_kills_are_read_from_the_kernel_and_the_memory_cgroup(tmp_path):
    from horizon_ray.cluster.cgroups import oom_kill_count

    (tmp_path / "vmstat").write_text("pgfault 12\noom_kill 3\n")
    cg = tmp_path / "cg"
    (cg / "kubepods" / "pod1").mkdir(parents=True)
    (cg / "kubepods" / "pod1" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    (tmp_path / "self-cgroup").write_text("0::/kubepods/pod1\n")
    assert oom_kill_count(str(tmp_path / "self-cgroup"), str(cg), str(tmp_path / "vmstat")) == 5
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "c1").mkdir(parents=True)
    (v1 / "memory" / "docker" / "c1" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n"
                                                                        "oom_kill 7\n")
    (tmp_path / "self-v1").write_text("5:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n")
    assert oom_kill_count(str(tmp_path / "self-v1"), str(v1), str(tmp_path / "none")) == 7
