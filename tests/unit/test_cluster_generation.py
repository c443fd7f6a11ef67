"""Placing a generation actor (cluster/generation.py): the model's size, the node picked, the agent's ledger."""

from horizon_ray.cluster.agent import ReservationRefused
from horizon_ray.cluster.generation import BASELINE_BYTES, model_host_bytes, pick_node
from horizon_ray.cluster.messages import NodeInfo, Reservation
from tests.tiny import JOB_LLAMA

GiB = 1 << 30


def _node(name, ram, reserved=0, gpus=0, busy=(), alive=True):
    ledger = [Reservation("j", reserved, 0, 0.0, gpu_indices=list(busy))] if reserved or busy else []
    return NodeInfo(node_id=name, ram_bytes=ram, gpu_count=gpus, reserved_bytes=reserved, ledger=ledger, alive=alive)


def test_the_best_fit_node_with_a_free_gpu_first():
    nodes = [_node("big", 64 * GiB), _node("snug", 12 * GiB, reserved=2 * GiB), _node("gone", 16 * GiB, alive=False),
             _node("small", 4 * GiB)]
    assert pick_node(nodes, 8 * GiB).node_id == "snug"  # 10 GiB free: the least left over
    assert pick_node(nodes, 8 * GiB, tried={"snug"}).node_id == "big"
    assert pick_node(nodes, 100 * GiB) is None
    gpu = [_node("cpu", 12 * GiB), _node("gpu", 64 * GiB, gpus=1), _node("busy-gpu", 16 * GiB, gpus=1, busy=[0])]
    assert pick_node(gpu, 8 * GiB).node_id == "gpu"


def test_a_model_is_sized_by_its_parameters_in_the_compute_dtype(tmp_path):
    from horizon_ray.engine import Engine, EngineConfig

    eng = Engine.from_config(JOB_LLAMA, EngineConfig(device="cpu"))
    eng.save_pretrained(tmp_path / "m")
    params = eng.num_params
    eng.close()
    assert model_host_bytes(tmp_path / "m") == 2 * params + BASELINE_BYTES


def test_an_adapter_on_a_quantized_base_is_sized_by_the_packed_base_it_runs_on(tmp_path):
    """An adapter trained with lora.quantize runs over its base quantized (quantized_base.json): the actor holds
    the packed layers (nf4: about half a byte a weight plus scales), not the bf16 ones."""
    from horizon_ray.engine import Engine, EngineConfig, LoraConfig
    from horizon_ray.engine.generate import Generator

    base = Engine.from_config(JOB_LLAMA, EngineConfig(device="cpu"))
    base.save_pretrained(tmp_path / "base")
    base.close()
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj"), quantize="nf4")
    eng = Engine.from_pretrained(tmp_path / "base", EngineConfig(device="cpu", compute_dtype="bfloat16", lora=lora))
    eng.save_pretrained(tmp_path / "adapter")
    eng.close()
    gen = Generator.from_pretrained(tmp_path / "adapter", device="cpu", dtype="bfloat16", tokenizer=None)
    held = sum(u.master.nbytes for u in gen.store.units) + sum(a.master.nbytes for a in gen.store.adapters)
    assert model_host_bytes(tmp_path / "adapter") == held + BASELINE_BYTES
    assert model_host_bytes(tmp_path / "adapter") < model_host_bytes(tmp_path / "base")


def test_a_generation_reservation_shares_the_agents_ledger_with_jobs(tmp_path):
    import sys

    import pytest

    from horizon_ray.cluster.agent import NodeAgent
    from horizon_ray.cluster.messages import Launch

    agent = NodeAgent("n1", ram_bytes=10 * GiB, gpu_count=1, command=[sys.executable, "-c", "pass"])
    try:
        res = agent.reserve_generation("generate:abc", 6 * GiB, gpu=True, tenant="acme")
        assert res.gpu_indices == [0] and agent.info().reserved_bytes == 6 * GiB
        assert [r.job_id for r in agent.info().ledger] == ["generate:abc"]
        launch = Launch(job_id="job-1", tenant="acme", spec={}, output_dir=str(tmp_path), host_bytes=5 * GiB,
                        gpu_bytes=0)
        with pytest.raises(ReservationRefused):  # the job does not fit beside the loaded model
            agent.start(launch)
        assert agent.poll({}) == {}  # not a job: the coordinator sees no stray to stop
        agent.release_generation("generate:abc")
        assert agent.info().reserved_bytes == 0
    finally:
        agent.shutdown()
