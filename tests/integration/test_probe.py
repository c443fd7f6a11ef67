"""The probe and the plans made with it: a CPU job's plan is made from this machine's probe and from the work
the job's run then does.

`horizon-ray probe` measures this machine (seconds); the planner plans the demo job (examples/demo.yaml, the
job `horizon-ray demo` runs) on it with those ceilings; `horizon-ray finetune` then runs the job. The tests
check what the plan is made of, never how long a step took: a timed bound fails whenever the machine is busy.
How close the planned step is to the measured one is a benchmark (benchmarks/plan_vs_run.py prints the ratio).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from horizon_ray.job.events import Metrics, Start, read_events
from horizon_ray.jobspec import JobSpec
from horizon_ray.planner import NodeSpec, plan_for_spec
from horizon_ray.probe import Probe

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _run(env, *args, timeout=600) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "horizon_ray", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_the_demos_plan_is_made_from_the_probe_of_its_node_and_the_work_its_run_does(tmp_path):
    """The step time is the planner's FLOPs and optimizer bytes over the rates the probe measured (none
    assumed), and those FLOPs and bytes count the job the run trains: its parameters, device, dtype and tokens
    a step."""
    from horizon_ray.job.demo import prepare_demo_assets

    env = {**os.environ, "HORIZON_RAY_HOME": str(tmp_path / "home")}
    prepare_demo_assets(tmp_path / "home")
    spec_path = ROOT / "examples" / "demo.yaml"
    probe = Probe.from_dict(json.loads(_run(env, "probe", "--json").stdout))
    assert {"cpu_flops", "cpu_matmul_flops", "adam_params_per_s"} <= set(probe.values)
    os.environ["HORIZON_RAY_HOME"] = env["HORIZON_RAY_HOME"]
    try:
        spec = JobSpec.from_yaml(spec_path, [f"training.max_steps={STEPS}"])
    finally:
        del os.environ["HORIZON_RAY_HOME"]
    ceilings = probe.ceilings()
    node = NodeSpec(ram_bytes=psutil.virtual_memory().total, gpus=0, gpu_mem_bytes=0, ceilings=ceilings,
                    name="this machine")
    planned = plan_for_spec(spec, node)
    assert planned.device == "cpu" and planned.assumed_ceilings == []

    # the step time: this plan's FLOPs at the probe's cpu_flops, plus its AdamW bytes at the probe's rate
    t = planned.timing
    assert t["compute_s"] == pytest.approx((t["fwd_flops"] + t["bwd_flops"]) / probe.values["cpu_flops"])
    adam_bytes_per_s = ceilings.adam_bytes_per_param * probe.values["adam_params_per_s"]
    assert t["optimizer_s"] == pytest.approx(t["optimizer_bytes"] / adam_bytes_per_s)
    assert planned.step_time_s == pytest.approx(t["compute_s"] + t["optimizer_s"])
    twice = dataclasses.replace(probe, values={k: 2 * v for k, v in probe.values.items()})
    faster = plan_for_spec(spec, dataclasses.replace(node, ceilings=twice.ceilings()))
    assert faster.step_time_s == pytest.approx(planned.step_time_s / 2)  # nothing in it but the probe's rates

    # the work those numbers count is the run's
    out = tmp_path / "run"
    _run(env, "finetune", "--config", str(spec_path), f"training.max_steps={STEPS}", f"output_dir={out}",
         "--no-progress")
    events = read_events(out / "metrics.jsonl")
    [start] = [e for e in events if isinstance(e, Start)]
    assert (start.device, start.compute_dtype, start.method) == (planned.device, planned.compute_dtype,
                                                                  planned.method)
    assert (start.num_params, start.trainable_params) == (planned.params, planned.trainable_params)
    seen = [e.tokens_seen for e in events if isinstance(e, Metrics)]
    assert len(seen) == STEPS
    trained = [b - a for a, b in zip([0, *seen], seen)]  # non-padding tokens of each step
    # packed rows: every step trains the plan's tokens less a little padding at the rows' ends
    assert all(0.9 * planned.tokens_per_step <= n <= planned.tokens_per_step for n in trained), \
        (trained, planned.tokens_per_step)


def test_the_probe_is_cached_per_machine_and_labels_what_it_did_not_measure(tmp_path):

    env = {**os.environ, "HORIZON_RAY_HOME": str(tmp_path)}
    first = json.loads(_run(env, "probe", "--json").stdout)
    again = json.loads(_run(env, "probe", "--json").stdout)
    assert again == first  # the cache, not a second measurement
    stale = dict(first, machine={**first["machine"], "host": "another-machine"})
    (tmp_path / "probe.json").write_text(json.dumps(stale))
    assert json.loads(_run(env, "probe", "--json").stdout)["time"] > first["time"]  # measured again
    text = _run(env, "probe").stdout
    assert "cpu_flops" in text and "measured: the engine's CPU step" in text
    assert "compute_efficiency" in text and "assumed: calibrated against the engine on the H200 box" in text
    if not Probe.from_dict(first).machine["gpus"]:
        assert "matmul_flops" in text and "assumed: the H200 box's (not measured here)" in text


def test_the_node_agent_probes_its_node_and_plans_with_what_it_measured(tmp_path, monkeypatch):
    """An agent probes its node when it starts (a child process, with the cores a CPU job alone there gets)
    and reports the ceilings with the node; the coordinator's planner plans that node with them."""
    from horizon_ray.cluster.agent import NodeAgent
    from horizon_ray.cluster.local import wait_for
    from horizon_ray.cluster.placement import default_planner

    monkeypatch.setenv("HORIZON_RAY_HOME", str(tmp_path))
    agent = NodeAgent("n", ram_bytes=8 * 2**30, gpu_count=0, cpu_count=1, probe=True)
    try:
        info = wait_for(lambda: agent.info() if agent.info().ceilings else None, 300, what="the agent's probe")
    finally:
        agent.shutdown()
    cached = Probe.from_dict(json.loads((tmp_path / "probe.json").read_text()))
    assert cached.machine["threads"] == 1  # the node's one core, not the agent's or the machine's
    assert info.ceilings == cached.wire()
    spec = {"model": {"path": "qwen2.5-0.5b"}, "data": {"path": "/d.jsonl"}, "training": {"max_steps": 1},
            "engine": {"device": "cpu"}}
    planned = default_planner(spec, info)
    assert planned["node"]["ceilings"]["cpu_flops"] == cached.values["cpu_flops"]
    assert planned["assumed_ceilings"] == [] and planned["node"]["ceilings"]["source"].startswith("probe of ")
