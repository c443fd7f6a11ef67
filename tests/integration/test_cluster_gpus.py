"""A multi-GPU node on a local Ray cluster, simulated: node g declares 2 logical GPUs (and 4 cores to split).

Two tiny demo jobs run side by side on g, each in its own `horizon-ray finetune` child bound to its own GPU
(CUDA_VISIBLE_DEVICES 0 and 1, read from the children's real environments) with half of the cores; a third
GPU job waits although g's RAM could hold it, and takes the GPU the first to finish frees. The jobs ask
for `engine.device: auto`, which the service treats as a GPU job on a node with GPUs; the children, finding
no CUDA on this machine, train on the CPU with the real engine.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.passes import after_a_pass

pytestmark = pytest.mark.integration

GiB = 2**30


@pytest.fixture(scope="module")
def gpu_service(tmp_path_factory):
    from horizon_ray.cluster.client import RayClient
    from horizon_ray.cluster.local import simulated_service
    from horizon_ray.cluster.nodes import parse_simulated_cluster
    from horizon_ray.job.demo import prepare_demo_assets

    home = tmp_path_factory.mktemp("assets")
    demo, _ = prepare_demo_assets(home)
    small = home / "train-small.jsonl"
    small.write_text("".join(demo.train_path.read_text().splitlines(keepends=True)[:32]))
    nodes = parse_simulated_cluster("g=8GiB:2gpu:4cpu")
    root = tmp_path_factory.mktemp("service")
    with simulated_service(root, nodes, node_dead_after_s=5):
        yield {"client": RayClient(), "model": str(demo.model_dir), "data": str(small)}


def spec(svc, steps: int) -> dict:
    return {"model": {"path": svc["model"]},
            "data": {"path": svc["data"], "format": "messages", "eval_fraction": 0.0},
            "training": {"max_steps": steps, "micro_batch_size": 2, "seq_len": 64, "lr": 1e-3,
                         "schedule": {"type": "constant"}},
            "engine": {"device": "auto"}}


def engine_env(output_dir: str) -> dict[str, str]:
    """The environment of the real engine process of the job writing to `output_dir`."""
    for p in psutil.process_iter(["cmdline"]):
        if f"{output_dir}/job.yaml" in " ".join(p.info["cmdline"] or []):
            env = p.environ()
            return {k: env.get(k) for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                                             "HORIZON_RAY_OPTIMIZER_THREADS", "HORIZON_RAY_JOB_ID")}
    raise AssertionError(f"no engine process for {output_dir}")


def wait_done(client, job_id, timeout=120.0):
    from horizon_ray.cluster.local import wait_for

    def check():
        job = client.get("gpus", job_id)
        return job if job.status.is_terminal() else None

    return wait_for(check, timeout, what=f"{job_id} to end")


def test_two_jobs_run_side_by_side_each_on_its_own_gpu(gpu_service):
    c = gpu_service["client"]
    first, second = after_a_pass(c, c.submit("gpus", spec(gpu_service, 4)), c.submit("gpus", spec(gpu_service, 6)))
    assert first.status.value == second.status.value == "running" and first.node_id == second.node_id == "g"
    assert {first.gpu_index, second.gpu_index} == {0, 1}
    (node,) = c.nodes()
    assert node.gpu_count == 2 and node.busy_gpus == [0, 1] and node.cpu_count == 4
    ledger = {r.job_id: (r.gpu_index, r.cpu_threads) for r in node.ledger}
    assert ledger == {first.id: (first.gpu_index, 2), second.id: (second.gpu_index, 2)}
    for job in (first, second):
        assert engine_env(job.output_dir) == {"CUDA_VISIBLE_DEVICES": str(job.gpu_index), "OMP_NUM_THREADS": "2",
                                              "HORIZON_RAY_OPTIMIZER_THREADS": "2", "HORIZON_RAY_JOB_ID": job.id}

    # g's RAM holds a third job, but both GPUs are busy: it waits, and gets the GPU the first job frees.
    third = after_a_pass(c, c.submit("gpus", spec(gpu_service, 2)))
    assert third.status.value == "queued" and third.queue_reason == "waiting for a free GPU (node g: all 2 GPUs busy)"
    assert node.free_bytes >= third.plan["host_bytes"]
    done = [wait_done(c, j.id) for j in (first, second, third)]
    assert [j.status.value for j in done] == ["succeeded"] * 3, [j.error for j in done]
    first, second, third = done
    assert first.started_at < second.finished_at and second.started_at < first.finished_at  # side by side
    freed = min((first, second), key=lambda j: j.finished_at)
    assert third.started_at >= freed.finished_at and third.gpu_index == freed.gpu_index
    for job in done:
        assert Path(job.output_dir, "final", "config.json").is_file()
        env_line = next(e.data for e in c.events("gpus", job.id) if e.data.get("to") == "running")
        assert env_line["gpu_index"] == job.gpu_index
    assert c.nodes()[0].busy_gpus == []
