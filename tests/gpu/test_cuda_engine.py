"""The CUDA pipeline against the CPU path (run on the GPU box: pytest -m gpu tests/gpu)."""

from functools import partial

import pytest
import torch

from horizon_ray.engine import Engine, EngineConfig
from tests.gpu.memory import peak_added
from tests.tiny import assert_close_but_adam_roundoff, llama_config, random_batches, step_grads

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only to be deselected
    pytest.skip("needs CUDA", allow_module_level=True)


def _run(device, config, steps=3, micro=2, dtype="float32", **kw):
    torch.backends.cuda.matmul.allow_tf32 = False
    kw.setdefault("max_grad_norm", 0.5)
    eng = Engine.from_config(config, EngineConfig(lr=1e-3, weight_decay=0.1, device=device, compute_dtype=dtype,
                                                  seed=0, **kw))
    batches = random_batches(steps, micro, T=32, prompt=4, vocab=config["vocab_size"])
    losses, eng.step_grads = [], []
    for mbs in batches:
        losses.append(eng.train_step(mbs))
        if device == "cpu":  # the reference's gradients (the CUDA run keeps its update overlapping the next step)
            eng.step_grads.append(step_grads(eng))
    eng.close()
    masters = torch.cat([u.master.float() for u in eng.store.units])
    return losses, masters, eng


def _assert_same(cpu, cuda, rtol, atol=1e-5):
    """Losses and weights agree at rtol, except the elements whose gradient was roundoff, which AdamW
    normalises (tests/tiny.py says why and how far they may differ)."""
    (lc, wc, ec), (lg, wg, _) = cpu, cuda
    assert lg == pytest.approx(lc, rel=rtol)
    if ec.step_grads:
        assert_close_but_adam_roundoff(wg, wc, ec.store.units, ec.step_grads, lr=1e-3, rtol=rtol, atol=atol)
    else:
        torch.testing.assert_close(wg, wc, rtol=rtol, atol=atol)


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("kernels", ["torch", "liger"])
def test_cuda_matches_cpu_fp32(K, tied, offload, kernels):
    """fp32 on both: Liger's kernels round once where torch's ops round after each, which in fp32 stays far
    inside rtol 1e-4 after three steps of AdamW."""
    if kernels == "liger":
        pytest.importorskip("liger_kernel")
    cfg = llama_config(4, tied=tied)
    cpu = _run("cpu", cfg, checkpoint_every=K)
    # Liger's RMSNorm sums its weight gradient in per-block fp32 partials and its cross-entropy takes the
    # log-sum-exp online: other orders than torch's, ~1e-7 relative a step, which AdamW's normalisation turns
    # into up to 1.4e-5 absolute on a few weights with small gradients (seen on the H200: 2 of 129,287): atol
    # 3e-5 for it, 1e-5 for torch's kernels
    _assert_same(cpu, _run("cuda", cfg, checkpoint_every=K, offload_checkpoints=offload, kernels=kernels),
                 rtol=1e-4, atol=3e-5 if kernels == "liger" else 1e-5)


@pytest.mark.parametrize("update", ["speculative", "delayed"])
def test_update_modes_on_cuda(update):
    """speculative without clipping is exact mode on CUDA too (the same device kernels and host update: to
    roundoff at most); delayed trains steps 0 and 1 on the initial weights, step 2 on those after step 0."""
    cfg = llama_config(4)
    exact = _run("cuda", cfg, max_grad_norm=1e6)
    other = _run("cuda", cfg, max_grad_norm=1e6, update=update)
    if update == "speculative":
        _assert_same(exact, other, rtol=1e-5)
        assert other[2].stats().speculated_units == len(other[2].store.units) - 1
    else:  # step 1 ran on the initial weights: the loss a fresh engine evaluates for its batch
        fresh = Engine.from_config(cfg, EngineConfig(device="cuda", seed=0))
        loss_sum, n = fresh.eval_loss(random_batches(3, 2, T=32, prompt=4, vocab=cfg["vocab_size"])[1])
        fresh.close()
        assert other[0][0] == pytest.approx(exact[0][0], rel=1e-5)
        assert other[0][1] == pytest.approx(loss_sum / n, rel=1e-5)
        assert other[0][1] != pytest.approx(exact[0][1], rel=1e-6)  # exact's step 1 saw step 0's update


def test_row_chunks_and_loss_chunks_do_not_change_the_step():
    cfg = llama_config(3)
    whole = _run("cuda", cfg, micro=2, layer_chunk_tokens=1 << 20, loss_chunk_tokens=1 << 20)
    split = _run("cuda", cfg, micro=2, layer_chunk_tokens=32, loss_chunk_tokens=7)
    _assert_same(whole, split, rtol=1e-4)


def test_many_thin_layers_expose_missing_events():
    """K=1 and 48 layers of tiny compute: copies race far ahead of compute, so a slot reused before its
    reader finished, or read before its copy landed, gives other weights and another result."""
    cfg = llama_config(48, hidden=32, inter=48, heads=2, kv=1)
    cpu = _run("cpu", cfg, steps=4, micro=3, checkpoint_every=1)
    for offload in (True, False):
        _assert_same(cpu, _run("cuda", cfg, steps=4, micro=3, checkpoint_every=1, offload_checkpoints=offload),
                     rtol=1e-4)


@pytest.mark.parametrize("kernels", ["torch", "liger"])
def test_bf16_cuda_close_to_fp32_cpu(kernels):
    if kernels == "liger":
        pytest.importorskip("liger_kernel")
    cfg = llama_config(4)
    lc, _, _ = _run("cpu", cfg)
    lg, _, _ = _run("cuda", cfg, dtype="bfloat16", kernels=kernels)
    for a, b in zip(lg, lc):
        assert a == pytest.approx(b, rel=3e-2)


def test_host_buffers_are_pinned_at_their_exact_size():
    cfg = llama_config(2, hidden=512, inter=1024, vocab=4096)
    eng = Engine.from_config(cfg, EngineConfig(device="cuda", compute_dtype="bfloat16"))
    for u in eng.store.units:
        assert u.wire.is_pinned() and u.grad is u.wire
        assert not u.master.is_pinned()  # only what crosses PCIe is page-locked
    eng.close()
    assert not eng.store.units[1].wire.is_pinned()  # close() unlocks it


def test_peak_gpu_memory_flat_when_the_host_runs_ahead_of_the_gpu():
    """An offloaded checkpoint's activations return to the allocator once compute has waited for their copy to
    the host, not once the GPU has caught up with the host's free of them: with the GPU held back at the first
    layer (the host queues the whole forward meanwhile), 16 layers add to a step's peak what 4 add. Marked used by
    the copy stream instead (record_stream), every layer the host ran ahead held its activations: 3.5 GiB at
    qwen3-4b's 16,384-token row groups on the H200."""
    added, checkpoint = [], 2 * 2 * 2048 * 1024 * 2  # two micro-batches of 2 x 2,048 tokens, 1,024 wide, bf16
    for layers in (4, 16):
        cfg = llama_config(layers, hidden=1024, inter=2816, vocab=8192, heads=16, kv=4)
        eng = Engine.from_config(cfg, EngineConfig(device="cuda", compute_dtype="bfloat16", kernels="torch",
                                                   checkpoint_every=1))
        batches = random_batches(2, 2, T=2048, prompt=4, vocab=cfg["vocab_size"])
        eng.train_step(batches[0])
        stash = eng._stash.stash

        def held_back(key, tensors, stash=stash):
            if key == 0:
                torch.cuda._sleep(1_000_000_000)  # about half a second of GPU clock cycles
            stash(key, tensors)

        eng._stash.stash = held_back
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # an allocation settles the frees the GPU has passed
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()["active_bytes.all.current"]
        eng.train_step(batches[1])
        torch.cuda.synchronize()
        # active, not allocated: max_memory_allocated stops counting a block at its tensor's free, even while the
        # allocator may not reuse it
        added.append(torch.cuda.memory_stats()["active_bytes.all.peak"] - before)
        eng.close()
    print("peak added by a held-back step at 4 and 16 layers:", added, "a checkpoint:", checkpoint)
    assert added[1] - added[0] < 3 * checkpoint, added


def test_peak_gpu_memory_flat_when_layers_double():
    peaks = []
    for layers in (8, 16):
        cfg = llama_config(layers, hidden=1024, inter=2816, vocab=8192, heads=16, kv=4)
        peaks.append(peak_added(partial(_run, "cuda", cfg, steps=2, micro=2, dtype="bfloat16", checkpoint_every=1)))
    # checkpoints are offloaded to the host; weights slots, accumulators and workspace do not depend on L
    print("peak GPU bytes at 8 and 16 layers:", peaks)
    assert peaks[1] <= peaks[0] * 1.05, peaks


def test_a_steps_peak_is_named_by_the_code_that_holds_it():
    """The bench's memory_at_peak on a CUDA step: the allocator's history replayed to the peak accounts for
    every byte the step held at its peak as the allocator's requested bytes count them (the size asked for, until
    the block may be reused), the engine's buffers as one holder and the rest by the engine code that allocated
    it (a layer's saved activations among them)."""
    from horizon_ray.bench.runtime import memory_at_peak

    cfg = llama_config(4, hidden=1024, inter=2816, vocab=8192, heads=16, kv=4)
    eng = Engine.from_config(cfg, EngineConfig(device="cuda", compute_dtype="bfloat16", kernels="torch"))
    batches = random_batches(2, 2, T=512, prompt=4, vocab=cfg["vocab_size"])
    eng.train_step(batches[0])
    out = memory_at_peak(lambda: eng.train_step(batches[1]), eng.device)
    engine_buffers = sum(eng.memory_report()["device"].values())
    eng.close()
    assert "gpu_peak_holders_error" not in out, out
    holders = dict((site, b) for site, b, _ in out["gpu_peak_holders"])
    assert out["gpu_peak_traced_bytes"] == out["gpu_peak_requested_bytes"]
    # the same blocks, each rounded up to what the allocator handed out
    assert out["gpu_peak_requested_bytes"] <= out["gpu_peak_active_bytes"] < 1.02 * out["gpu_peak_requested_bytes"]
    assert sum(holders.values()) == out["gpu_peak_traced_bytes"]
    assert holders["before the step (engine buffers)"] >= engine_buffers
    assert any("layers.py" in site for site in holders), holders


def test_the_runner_builds_the_engine_at_the_row_groups_its_gpu_holds():
    """engine.layer_chunk_tokens auto on CUDA: the runner plans the job on this GPU and builds the engine at the
    largest row group that fits (16,384 tokens of qwen3-4b's full fine-tuning on an 80-141 GiB GPU), with split
    GEMMs there (fuse_projections auto); a row group the spec sets stays."""
    from horizon_ray.job.runner import engine_config
    from horizon_ray.jobspec import JobSpec

    spec = {"model": {"path": "qwen3-4b"}, "data": {"path": "/data/train.jsonl"}, "output_dir": "/runs/x",
            "training": {"max_steps": 1, "seq_len": 1024, "micro_batch_size": 16}, "engine": {"device": "cuda"}}
    cfg = engine_config(JobSpec.from_dict(spec))
    assert (cfg.layer_chunk_tokens, cfg.fuse_projections) == (16384, False)
    spec["engine"]["layer_chunk_tokens"] = 8192
    cfg = engine_config(JobSpec.from_dict(spec))
    assert (cfg.layer_chunk_tokens, cfg.fuse_projections) == (8192, True)
