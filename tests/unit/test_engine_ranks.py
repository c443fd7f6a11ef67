"""Several ranks of one job over one host store (engine/ranks.py): gloo ranks on the CPU against one process
with all their micro-batches."""

import pytest
import torch
import torch.distributed as dist

from horizon_ray.engine import Engine, EngineConfig, LoraConfig, ModelConfig
from horizon_ray.engine.ranks import Ranks
from tests.tiny import llama_config, random_batches, run_ranks

WORLD, MICRO = 2, 2  # two ranks, each with two micro-batches a step: one process with four


def _rank(rank, rendezvous, config, cfg, store, batches, results):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        eng = Engine(ModelConfig.load(config), cfg, store=store, ranks=Ranks(rank, WORLD))
        out = []
        for mbs in batches:
            loss = eng.train_step(mbs[rank * MICRO:(rank + 1) * MICRO])
            out.append((loss, eng.last_grad_norm))
        eng.synchronize()
        results.put((rank, out, [u.step.item() for u in store.trained]))
        dist.barrier()  # no rank leaves (and unmaps the store) before every rank's shard is written
        eng.close()
    finally:
        dist.destroy_process_group()


def _run_ranks(config, cfg, batches):
    model, store = Engine.shared_store(config, cfg, world=WORLD)
    return run_ranks(_rank, WORLD, config, cfg, store, batches), store


@pytest.mark.parametrize("kw", [{}, {"compute_dtype": "bfloat16"},
                                {"lora": LoraConfig(r=4, alpha=8, dropout=0.1, targets=("q_proj", "down_proj"))}])
def test_two_ranks_match_one_process_with_all_their_micro_batches(kw):
    config = llama_config(3)
    cfg = EngineConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, seed=0, **kw)
    batches = random_batches(3, WORLD * MICRO, T=16)
    ref = Engine.from_config(config, cfg)
    want = [(ref.train_step(mbs), ref.last_grad_norm) for mbs in batches]
    ref.synchronize()
    ranks, store = _run_ranks(config, cfg, batches)
    for rank, got, steps in ranks:
        # each rank reports the step's loss over every rank's tokens, and the global norm
        for (lg, ng), (lw, nw) in zip(got, want):
            assert lg == pytest.approx(lw, rel=1e-5) and ng == pytest.approx(nw, rel=1e-5), rank
        assert steps == [3.0] * len(store.trained)  # each rank counted its shard's AdamW steps
    # the shared store holds one copy of the trained weights, every shard updated by its rank
    for a, b in zip(store.trained, ref.store.trained):
        torch.testing.assert_close(a.master.float(), b.master.float(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a.exp_avg_sq.float(), b.exp_avg_sq.float(), rtol=1e-4, atol=1e-10)
    ref.close()


def test_ranks_split_every_unit_into_contiguous_shards():
    sizes = [7, 8, 1, 0]
    for world in (1, 2, 3):
        for n in sizes:
            parts = [Ranks(r, world).shard(n) for r in range(world)]
            covered = [i for p in parts for i in range(p.start, p.stop)]
            assert covered == list(range(n))  # each element once, in order
            assert Ranks(0, world).padded(n) % world == 0 and Ranks(0, world).padded(n) >= n


def test_speculative_with_several_ranks_is_refused():
    from horizon_ray.errors import BadInput

    cfg = EngineConfig(update="speculative")
    model, store = Engine.shared_store(llama_config(2), cfg, world=2)
    with pytest.raises(BadInput, match="use update exact or delayed with several GPUs"):
        Engine(model, cfg, store=store, ranks=Ranks(0, 2))
