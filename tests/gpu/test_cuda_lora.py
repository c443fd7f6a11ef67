"""LoRA's CUDA pipeline against its CPU path (run on the GPU box: pytest -m gpu tests/gpu/test_cuda_lora.py).

The base streams through the layer slots as in full fine-tuning, each layer's fp32 adapters in an adapter
slot beside its base; their gradients accumulate in one of two pooled buffers and leave once a step. These
tests pin that schedule's events (an adapter slot overwritten while read, or read before its copy landed,
changes the numbers), its numerics against the CPU (which test_engine_lora.py pins against PEFT), and its
memory: flat in the layer count, within the plan.
"""


from functools import partial

import pytest
import torch

from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from tests.gpu.memory import peak_added
from tests.tiny import assert_close_but_adam_roundoff, llama_config, random_batches, step_grads

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only to be deselected
    pytest.skip("needs CUDA", allow_module_level=True)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _run(device, config, steps=3, micro=2, dtype="float32", lora=None, B=2, T=32, **kw):
    """Same base (from_config's seed) and same initial adapters on both devices; returns the losses, the
    adapters after the last update, the last gradient norm and the engine (whose ``step_grads`` holds each
    step's adapter gradients, clipped as the update read them)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    lora = lora or LoraConfig(r=4, alpha=8, targets=ALL)
    eng = Engine.from_config(config, EngineConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, device=device,
                                                  compute_dtype=dtype, seed=0, lora=lora, **kw))
    batches = random_batches(steps, micro, B=B, T=T, prompt=4, vocab=config["vocab_size"])
    losses, eng.step_grads = [], []
    for mbs in batches:
        losses.append(eng.train_step(mbs))
        if device == "cpu":  # the reference's gradients (the CUDA run keeps its update overlapping the next step)
            eng.step_grads.append(step_grads(eng))
    norms = eng.last_grad_norm
    eng.close()
    adapters = torch.cat([u.master for u in eng.store.adapters])
    return losses, adapters, norms, eng


def _assert_same(cpu, cuda, rtol):
    """Losses, norms and adapters agree at rtol, except the adapter elements whose gradient was roundoff,
    which AdamW normalises (tests/tiny.py says why and how far they may differ)."""
    (lc, ac, nc, ec), (lg, ag, ng, _) = cpu, cuda
    assert lg == pytest.approx(lc, rel=rtol)
    assert ng == pytest.approx(nc, rel=rtol)
    assert_close_but_adam_roundoff(ag, ac, ec.store.adapters, ec.step_grads, lr=1e-3, rtol=rtol)


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("offload", [True, False])
def test_cuda_lora_matches_cpu_fp32(K, tied, offload):
    cfg = llama_config(4, tied=tied)
    cpu = _run("cpu", cfg, checkpoint_every=K)
    _assert_same(cpu, _run("cuda", cfg, checkpoint_every=K, offload_checkpoints=offload), rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_cuda_trained_norms_match_cpu(tied):
    """modules_to_save=["norm"]: each layer's norms sit in its resident adapter range, the final norm in the
    head's own adapter unit (read with the head slot, flushed after the loss)."""
    cfg = llama_config(4, tied=tied)
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj"), modules_to_save=("norm",))
    cpu = _run("cpu", cfg, lora=lora, checkpoint_every=2)
    cuda = _run("cuda", cfg, lora=lora, checkpoint_every=2)
    _assert_same(cpu, cuda, rtol=1e-4)
    assert cuda[3].store.adapters[-1].layout.name == "lora.head"


def test_many_thin_layers_expose_missing_adapter_events():
    """K=1, 48 tiny layers, every step's update re-copies each resident adapter: copies race far ahead of
    compute, so an adapter overwritten before its reader finished, or read before its copy landed, or a
    gradient copied out before it was complete, gives another result."""
    cfg = llama_config(48, hidden=32, inter=48, heads=2, kv=1)
    lora = LoraConfig(r=2, alpha=4, targets=("q_proj", "v_proj", "down_proj"))
    cpu = _run("cpu", cfg, steps=5, micro=3, lora=lora, checkpoint_every=1)
    for offload in (True, False):
        _assert_same(cpu, _run("cuda", cfg, steps=5, micro=3, lora=lora, checkpoint_every=1,
                               offload_checkpoints=offload), rtol=1e-4)


def test_eval_between_steps_sees_each_update():
    """forward_logits between steps reads the adapters the host optimizer just wrote, on both devices."""
    cfg = llama_config(3)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for device in ("cpu", "cuda"):
        eng = Engine.from_config(cfg, EngineConfig(lr=1e-2, device=device, seed=0,
                                                   lora=LoraConfig(r=4, targets=ALL)))
        logits[device] = []
        for mbs in random_batches(3, 2, T=32, prompt=4):
            eng.train_step(mbs)
            logits[device].append(eng.forward_logits(ids))
        eng.close()
    for a, b in zip(logits["cuda"], logits["cpu"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits["cpu"][0], logits["cpu"][-1], atol=1e-4)  # the adapters moved


def test_bf16_cuda_lora_close_to_fp32_cpu():
    cfg = llama_config(4)
    lc, _, _, _ = _run("cpu", cfg)
    lg, _, _, eng = _run("cuda", cfg, dtype="bfloat16")
    assert all(u.wire.dtype == torch.bfloat16 for u in eng.store.units)  # 2 bytes a base parameter
    for a, b in zip(lg, lc):
        assert a == pytest.approx(b, rel=3e-2)


def test_dropout_is_deterministic_on_cuda():
    cfg = llama_config(4)
    lora = LoraConfig(r=4, alpha=8, dropout=0.2, targets=ALL)
    a = _run("cuda", cfg, lora=lora, checkpoint_every=1)
    b = _run("cuda", cfg, lora=lora, checkpoint_every=1)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    k2 = _run("cuda", cfg, lora=lora, checkpoint_every=2)  # the recompute draws the forward's masks
    _assert_same(a, k2, rtol=1e-4)
    plain = _run("cuda", cfg, checkpoint_every=1)
    assert not torch.allclose(a[1], plain[1], rtol=1e-3, atol=1e-6)  # the masks change the adapters' step


def test_host_and_device_buffers():
    cfg = llama_config(2, hidden=512, inter=1024, vocab=4096)
    eng = Engine.from_config(cfg, EngineConfig(device="cuda", compute_dtype="bfloat16",
                                               lora=LoraConfig(r=8, targets=ALL)))
    for u in eng.store.units:
        assert u.wire.is_pinned() and u.master is u.wire and u.grad.numel() == 0  # frozen: only the wire
    for a in eng.store.adapters:
        assert a.master.is_pinned() and a.grad.is_pinned() and a.master.dtype == torch.float32
    dev = eng.memory_report()["device"]
    per_unit = max(a.layout.numel for a in eng.store.adapters)
    # one adapter slot beside each weight slot (2 layer slots at K=1, the head's; untied: no embedding slot)
    assert dev["adapter_slots"] == 4 * per_unit * 3 and dev["adapter_grads"] == 4 * per_unit * 2
    assert dev["grad_accumulators"] == 0 and "grad_staging" not in dev  # no base gradient anywhere
    eng.close()
    assert not eng.store.units[1].wire.is_pinned()  # close() unlocks it


def test_peak_gpu_memory_flat_when_layers_double():
    peaks = []
    for layers in (8, 16):
        cfg = llama_config(layers, hidden=1024, inter=2816, vocab=8192, heads=16, kv=4)
        peaks.append(peak_added(partial(_run, "cuda", cfg, steps=2, micro=2, dtype="bfloat16",
                                        lora=LoraConfig(r=16, targets=ALL), checkpoint_every=1)))
    # checkpoints are offloaded and adapters travel with their layer: nothing on the device grows with L
    print("peak GPU bytes at 8 and 16 layers (LoRA):", peaks)
    assert peaks[1] <= peaks[0] * 1.05, peaks


def test_peak_gpu_memory_within_the_plan():
    from horizon_ray.planner import CUDA_CONTEXT_BYTES, Adapters, plan

    cfg = llama_config(8, hidden=1024, inter=2816, vocab=8192, heads=16, kv=4)
    micro, T, B = 2, 512, 4  # 4096 tokens a step: the activations, not the cuBLAS workspace, dominate
    peak = peak_added(lambda: _run("cuda", cfg, steps=2, micro=micro, dtype="bfloat16",
                                   lora=LoraConfig(r=16, targets=ALL), B=B, T=T, checkpoint_every=2))
    p = plan(cfg, method="lora", lora=Adapters(r=16, targets=ALL), compute_dtype="bfloat16", device="cuda",
             seq_len=T, micro_batch_size=B, grad_accum=micro, checkpoint_every=2)
    planned = p.gpu_bytes - CUDA_CONTEXT_BYTES
    print(f"peak allocated {peak / 2**20:.0f} MiB = {peak / planned:.0%} of the plan without the CUDA context "
          f"({planned / 2**20:.0f} MiB): {p.breakdown['gpu']}")
    assert peak <= planned


def test_adapter_trained_on_cuda_loads_on_cpu(tmp_path):
    cfg = llama_config(3)
    _, _, _, eng = _run("cuda", cfg)
    base = Engine.from_config(cfg, EngineConfig(device="cpu", seed=0))
    base.save_pretrained(tmp_path / "base")
    eng.base_model_path = str(tmp_path / "base")  # from_config has no directory of its own
    out = eng.save_pretrained(tmp_path / "adapter")
    cpu = Engine.from_pretrained(out, EngineConfig(device="cpu"))
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cpu.forward_logits(ids), eng.forward_logits(ids), rtol=1e-4, atol=1e-4)
