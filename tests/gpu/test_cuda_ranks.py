"""Several ranks of one job on one node's GPUs (engine/ranks.py over NCCL), against one CUDA process with all
their micro-batches: the CPU's gloo test (tests/unit/test_engine_ranks.py) on the path it cannot take, where each
rank reduce-scatters a unit's gradient on its GPU and a copy stream sends the shard to the host. Needs two GPUs."""

import pytest
import torch
import torch.distributed as dist

from horizon_ray.engine import Engine, EngineConfig, LoraConfig, ModelConfig
from horizon_ray.engine.ranks import Ranks
from tests.tiny import llama_config, random_batches, run_ranks

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only to be deselected
    pytest.skip("needs CUDA", allow_module_level=True)

WORLD, MICRO = 2, 2  # two ranks, each with two micro-batches a step: one process with four


def _rank(rank, rendezvous, config, cfg, store, batches, results):
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        eng = Engine(ModelConfig.load(config), cfg, store=store, ranks=Ranks(rank, WORLD))
        sink, send = eng._grad_sink, eng._grad_sink._d2h

        def late(host, dev):
            # every gradient's copy to the host starts ~10 ms late, while compute goes on: a shard freed before
            # its copy has read it is then overwritten by compute's next allocations
            with torch.cuda.stream(sink.d2h):
                torch.cuda._sleep(20_000_000)
            return send(host, dev)

        sink._d2h = late
        out = []
        for mbs in batches:
            loss = eng.train_step(mbs[rank * MICRO:(rank + 1) * MICRO])
            out.append((loss, eng.last_grad_norm))
        eng.synchronize()
        results.put((rank, out))
        dist.barrier()  # no rank leaves (and unmaps the store) before every rank's shard is written
        eng.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kw", [{}, {"lora": LoraConfig(r=4, alpha=8, targets=("q_proj", "down_proj"))}])
def test_two_gpu_ranks_match_one_process_with_all_their_micro_batches(kw):
    """float32 compute: each rank's reduce-scattered shard is the tensor the copy to the host reads (bfloat16 casts
    it into a staging buffer first), so it must outlive that copy; LoRA's adapter gradients likewise."""
    torch.backends.cuda.matmul.allow_tf32 = False
    config = llama_config(3, hidden=256, inter=512, vocab=1024, heads=4, kv=2)
    cfg = EngineConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, seed=0, device="cuda", **kw)
    batches = random_batches(3, WORLD * MICRO, T=64, vocab=config["vocab_size"])
    ref = Engine.from_config(config, cfg)
    want = [(ref.train_step(mbs), ref.last_grad_norm) for mbs in batches]
    ref.synchronize()
    _, store = Engine.shared_store(config, cfg, world=WORLD)
    for rank, out in run_ranks(_rank, WORLD, config, cfg, store, batches):
        for (lg, ng), (lw, nw) in zip(out, want):
            assert lg == pytest.approx(lw, rel=1e-4) and ng == pytest.approx(nw, rel=1e-4), rank
    # the shared store holds one copy of the trained weights, every shard updated by its rank
    for a, b in zip(store.trained, ref.store.trained):
        torch.testing.assert_close(a.master.float(), b.master.float(), rtol=1e-3, atol=1e-5)
    ref.close()
