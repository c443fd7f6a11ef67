"""GPUs asked for that a node does not have: `resources.gpus: N` with engine.device auto is N GPUs (a node without
GPUs never holds it; CPU ranks are engine.device cpu), and a cuda job on a node whose torch sees no CUDA (a
simulated GPU node) fails with what to do, before any rank starts."""

from __future__ import annotations

import pytest

from horizon_ray.cluster import JobRejected, JobStatus
from horizon_ray.cluster.placement import needs_gpu
from horizon_ray.jobspec import JobSpec


def spec(device: str = "auto", gpus: int = 4) -> dict:
    return {"model": {"path": "/models/10GiB"}, "data": {"path": "/data/train.jsonl"},
            "training": {"max_steps": 10}, "engine": {"device": device}, "resources": {"gpus": gpus}}


def test_several_gpus_with_device_auto_are_gpus_and_no_cpu_node_holds_them(fake_cluster):
    assert needs_gpu(spec("auto", 4), 0) and not needs_gpu(spec("auto", 1), 0) and not needs_gpu(spec("cpu", 4), 0)
    c = fake_cluster({"a": "64GiB", "b": "128GiB"}, auto=False)
    with pytest.raises(JobRejected) as refused:
        c.submit("acme", spec("auto", 4))
    message = str(refused.value)
    assert ("no node can ever hold this job: resources.gpus 4 needs 4 GPUs of one node and no node has a GPU; set "
            "engine.device cpu to train on 4 CPU ranks, or add a GPU node") in message, message
    nodes = {n["node_id"]: n["reason"] for n in refused.value.details["nodes"]}
    assert nodes["a"].startswith("resources.gpus 4 needs 4 GPUs of one node; node a has none"), nodes
    ranks = c.submit("acme", spec("cpu", 2))  # CPU ranks, asked for as such
    assert ranks.status is JobStatus.RUNNING and ranks.gpu_indices == []


def test_several_gpus_with_device_auto_name_the_largest_gpu_node(fake_cluster):
    c = fake_cluster({"a": "64GiB", "g": "512GiB:2gpu"}, auto=False)
    with pytest.raises(JobRejected, match=r"the most any node has is 2 \(node g\); ask for at most 2"):
        c.submit("acme", spec("auto", 4))
    job = c.submit("acme", spec("auto", 2))
    assert (job.node_id, job.gpu_indices) == ("g", [0, 1])


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_cuda_job_where_torch_sees_no_cuda_fails_with_the_fix(gpus):
    import torch

    from horizon_ray.engine import EngineConfig

    if torch.cuda.is_available():
        pytest.skip("this torch sees CUDA")
    job = JobSpec.from_dict({**spec("cuda", gpus), "output_dir": "out"})
    with pytest.raises(ValueError) as err:
        EngineConfig.from_spec(job)
    assert "engine.device cuda needs CUDA, and torch" in str(err.value) and "set engine.device to cpu" in str(err.value)
    assert getattr(err.value, "field", None) == "engine.device"
    assert EngineConfig.from_spec(JobSpec.from_dict({**spec("auto", gpus), "output_dir": "out"})).device == "cpu"
