"""The engine against HF transformers + torch.optim.AdamW on tiny models built here.

Reference semantics: the HF model in float32, summed token loss / total non-ignored tokens of the step,
clip_grad_norm_, torch.optim.AdamW on float32 parameters.

Tolerances: float32, rtol 1e-4 on loss, gradients and weights. Weights also get atol 1e-5: the k_proj bias
of Qwen2 has a gradient that is zero in exact arithmetic (softmax ignores a shift shared by all keys), so
both sides update it by Adam-normalised rounding noise of size ~lr; every other tensor matches far tighter.
bfloat16 compute is compared with the same float32 reference at rtol 3e-2 on the loss (bf16 has 8 bits of
mantissa and the errors of 2-4 layers add up).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    MistralConfig,
    MistralForCausalLM,
)

from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from horizon_ray.engine.layers import Template
from horizon_ray.errors import BadInput
from tests.tiny import (
    V,
    named_tensors,
    random_batches,
    reference_step,
    resumed_and_uninterrupted,
    save,
    step_grads,
    tiny_llama,
    tiny_phi3,
    tiny_qwen2,
    tiny_qwen3,
)

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _engine_tensors(eng, kind):
    return named_tensors(eng.store.units, kind)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("K", [1, 2, "L"])
def test_matches_hf_and_adamw_fp32(tmp_path, family, K):
    path, cls = (tiny_llama if family == "llama" else tiny_qwen2)(tmp_path)
    ref = cls.from_pretrained(path).float()
    K = ref.config.num_hidden_layers if K == "L" else K
    max_norm = 0.5  # small enough that clipping is active on every step
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=max_norm, checkpoint_every=K,
                                                    device="cpu", compute_dtype="float32"))
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    clipped = 0
    for step, mbs in enumerate(random_batches(3, micro=2)):
        loss = eng.train_step(mbs)
        ref_loss, ref_norm, ref_grads = reference_step(ref, dict(ref.named_parameters()), opt, mbs, max_norm)
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert eng.last_grad_norm == pytest.approx(ref_norm, rel=1e-4)
        clipped += ref_norm > max_norm
        eng.close()  # the update runs in the background; afterwards the host holds the clipped gradients
        grads = _engine_tensors(eng, "grad")
        if ref.config.tie_word_embeddings:
            assert "lm_head.weight" not in grads
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"grad {name}, step {step}")
    assert clipped == 3
    eng.close()
    masters = _engine_tensors(eng, "master")
    for name, p in ref.named_parameters():
        if name == "lm_head.weight" and ref.config.tie_word_embeddings:
            continue
        torch.testing.assert_close(masters[name], p.detach(), rtol=1e-4, atol=1e-5, msg=f"weight {name}")


def test_bf16_compute_close_to_fp32_reference(tmp_path):
    path, cls = tiny_llama(tmp_path)
    ref = cls.from_pretrained(path).float()
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=1.0, checkpoint_every=2, device="cpu",
                                                    compute_dtype="bfloat16"))
    assert eng.store.units[1].grad.dtype == torch.bfloat16
    assert eng.store.units[1].master.dtype == torch.float32
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    for mbs in random_batches(3, micro=2):
        loss = eng.train_step(mbs)
        ref_loss, ref_norm, _ = reference_step(ref, dict(ref.named_parameters()), opt, mbs, 1.0)
        assert loss == pytest.approx(ref_loss, rel=3e-2)
        assert eng.last_grad_norm == pytest.approx(ref_norm, rel=5e-2)


def test_gradient_accumulation_is_token_weighted(tmp_path):
    """Two micro-batches with different numbers of targets equal one batch holding both."""
    path, _ = tiny_llama(tmp_path)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100  # row 0: 2 targets, row 1: 9 targets
    cfg = EngineConfig(**HP, device="cpu")
    a = Engine.from_pretrained(path, cfg)
    b = Engine.from_pretrained(path, cfg)
    la = a.train_step([(ids, labels)])
    lb = b.train_step([(ids[:1], labels[:1]), (ids[1:], labels[1:])])
    a.close()
    b.close()
    assert la == pytest.approx(lb, rel=1e-5)
    for x, y in zip(_engine_tensors(a, "grad").values(), _engine_tensors(b, "grad").values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_llama3_rope_scaling_matches_hf(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    path, cls = tiny_llama(tmp_path, rope_parameters=rope, max_position_embeddings=64)
    ref = cls.from_pretrained(path).float()
    eng = Engine.from_pretrained(path, EngineConfig(device="cpu"))
    assert eng.model.rope_llama3 is not None
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(eng.forward_logits(ids), ref(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5)


def test_mistral_sliding_window_matches_hf(tmp_path):
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=V, sliding_window=5, attn_implementation="sdpa")
    path, cls = save(MistralForCausalLM(cfg), tmp_path)
    ref = cls.from_pretrained(path, attn_implementation="sdpa").float()
    eng = Engine.from_pretrained(path, EngineConfig(device="cpu"))
    assert eng.model.sliding_window == 5
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(eng.forward_logits(ids), ref(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5)


def test_packed_documents_do_not_attend_across(tmp_path):
    path, _ = tiny_llama(tmp_path)
    eng = Engine.from_pretrained(path, EngineConfig(device="cpu"))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, V, (1, 7), generator=g), torch.randint(0, V, (1, 5), generator=g)
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    logits = eng.forward_logits(packed, positions)
    torch.testing.assert_close(logits[:, :7], eng.forward_logits(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, 7:], eng.forward_logits(b), rtol=1e-5, atol=1e-5)
    # without the document boundary the second document's logits change: the mask is what isolates them
    plain = eng.forward_logits(packed)
    assert not torch.allclose(plain[:, 7:], logits[:, 7:], atol=1e-3)


@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 40_000])
def test_save_pretrained_loads_in_transformers(tmp_path, shard_bytes):
    path, cls = tiny_qwen2(tmp_path)
    eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", max_shard_bytes=shard_bytes))
    for mbs in random_batches(2, micro=1):
        eng.train_step(mbs)
    out = eng.save_pretrained(tmp_path / "out")
    sharded = (out / "model.safetensors.index.json").is_file()
    assert sharded == (shard_bytes < 5 * 2**30)
    loaded = cls.from_pretrained(out).float()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(eng.forward_logits(ids), loaded(input_ids=ids).logits.float(), rtol=1e-5, atol=1e-5)
    # and the engine reads its own output back to the same weights
    again = Engine.from_pretrained(out, EngineConfig(device="cpu"))
    for x, y in zip(_engine_tensors(eng, "master").values(), _engine_tensors(again, "master").values()):
        assert torch.equal(x, y)


def test_state_round_trip_continues_exactly(tmp_path):
    path, _ = tiny_llama(tmp_path)
    a, c = resumed_and_uninterrupted(path, EngineConfig(**HP, device="cpu"), random_batches(4, micro=2))
    for x, y in zip(_engine_tensors(a, "master").values(), _engine_tensors(c, "master").values()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_fused_and_split_projections_train_alike(tmp_path, family):
    """fuse_projections=False runs q, k, v and gate, up as their own GEMMs (and Qwen3's per-head norm on its own
    q and k): the same step, and every split weight's gradient reaches its accumulator (the backward keys its
    sinks as the weights it read; a fused sink under split weights would drop the projections' gradients).
    Phi-3 stores its qkv and gate_up as one tensor each, which stay one GEMM either way."""
    path, _ = {"llama": tiny_llama, "qwen3": tiny_qwen3, "phi3": tiny_phi3}[family](tmp_path)
    batches = random_batches(2, micro=2, B=4)
    results = []
    for fuse in (True, False):
        eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", fuse_projections=fuse))
        loss = eng.train_step(batches[0])
        grads = step_grads(eng)
        losses = [loss, eng.train_step(batches[1])]
        eng.close()
        results.append((losses, grads))
    (want_losses, want), (got_losses, got) = results
    assert got_losses == pytest.approx(want_losses, rel=1e-6)
    assert want.abs().max() > 0
    # summation order only; a dropped projection gradient would be a block of zeros
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


class _GemmLog(TorchDispatchMode):
    """The input shapes of every aten.mm the step runs."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.shapes.append(tuple(tuple(a.shape) for a in args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_recompute_leaves_the_down_projection_to_the_backward(tmp_path, method):
    """The recompute of a checkpointed layer does not run its MLP's down projection: nothing but the residual
    sum reads its product, so the backward runs only the GEMMs of its gradients (HF's checkpointing skips it too).
    The down projection's forward GEMM ([tokens, intermediate] x [intermediate, hidden]; full fine-tuning runs
    gate and up fused, so their input gradients are [tokens, 2 x intermediate] products) runs once a layer and
    micro-batch, in the step's forward; the step itself matches HF and torch's AdamW (and PEFT) in the other
    tests."""
    path, _ = tiny_llama(tmp_path)
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj")) if method == "lora" else None
    eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", lora=lora))
    cfg = eng.model
    H, inter, L = cfg.hidden_size, cfg.layers[0].mlp.width, cfg.num_layers
    mbs = random_batches(1, micro=2, B=4)[0]
    with _GemmLog() as log:
        eng.train_step(mbs)
    grads = step_grads(eng)
    eng.close()
    tokens = mbs[0][0].numel()
    down = ((tokens, inter), (inter, H))
    # LoRA runs gate and up as their own GEMMs: their input gradients share the shape, two a layer
    input_grads = 2 * L * len(mbs) if method == "lora" else 0
    assert log.shapes.count(down) == L * len(mbs) + input_grads  # L x micro-batches more before: the recompute
    assert grads.abs().max() > 0


@pytest.mark.parametrize("setting", [
    dict(),
    dict(fuse_projections=False, checkpoint_every=2, layer_chunk_tokens=12),
    dict(lora=LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj"))),
    dict(lora=LoraConfig(r=4, alpha=8, targets=("gate_proj", "up_proj"))),  # layer 0: only the MLP trains
    dict(lora=LoraConfig(r=4, alpha=8, targets=("o_proj",), modules_to_save=("norm",))),
    dict(lora=LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj"), quantize="nf4")),
], ids=["full", "split-ckpt2-rows", "lora-qv", "lora-gate-up", "lora-o-norm", "qlora-qv"])
def test_the_deferred_down_projection_gives_the_full_recomputes_gradients(tmp_path, monkeypatch, setting):
    """The same GEMMs compute the same gradients: bit for bit what the full recompute of each layer gives, in
    full fine-tuning (fused or split, several layers to a checkpoint, row groups of one sequence) and under
    LoRA and QLoRA whatever the adapters' place (below the down projection or not at all in the MLP)."""
    path, _ = tiny_llama(tmp_path)
    mbs = random_batches(1, micro=2, B=4)[0]
    grads = []
    for defer in (True, False):
        if not defer:
            monkeypatch.setattr(Template, "layer_for_backward", Template.layer)
        eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", **setting))
        eng.train_step(mbs)
        grads.append(step_grads(eng))
        eng.close()
    assert grads[0].abs().max() > 0
    assert torch.equal(grads[0], grads[1])


def test_fuse_projections_is_a_bool():
    with pytest.raises(BadInput, match="fuse_projections must be true or false"):
        EngineConfig(fuse_projections="yes").validate()


def test_row_and_loss_chunks_do_not_change_the_step(tmp_path):
    path, _ = tiny_llama(tmp_path)
    batches = random_batches(2, micro=2, B=4)
    results = []
    for layer_chunk, loss_chunk in [(1 << 20, 1 << 20), (12, 5)]:  # 12 tokens = one row per chunk
        eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", layer_chunk_tokens=layer_chunk,
                                                        loss_chunk_tokens=loss_chunk))
        losses = [eng.train_step(mbs) for mbs in batches]
        eng.close()
        results.append((losses, _engine_tensors(eng, "master")))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for name, w in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], w, rtol=1e-4, atol=1e-5)  # summation order only
