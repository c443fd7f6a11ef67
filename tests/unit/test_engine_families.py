"""The families beyond Llama / Qwen2 / Mistral against HF transformers + torch.optim.AdamW, and PEFT.

Each family is a tiny random model built here (tests/tiny.py) with what sets it apart switched on: Qwen3's
per-head q/k norms and explicit head_dim; Phi-3's fused qkv_proj and gate_up_proj; Gemma 2's (1 + w)
norms around attention and the MLP, GELU-tanh, scaled embeddings, query_pre_attn_scalar, alternating
sliding (window 5 of 12 tokens) and global layers, attention and final logit caps tight enough to bend the
numbers; Gemma 3's q/k norms and its sliding and global layers' own RoPE (the global one interpolated);
Mixtral, Qwen3-MoE and OLMoE's routers, experts and the load-balancing loss (weighted 0.05-0.1, so that it
moves the gradients); Qwen2-MoE's shared expert under its sigmoid gate, with a dense layer below its MoE layers
(per-layer layouts), as Qwen3-MoE's mlp_only_layers and decoder_sparse_step give too.

Reference semantics as in test_engine_numerics.py: the HF model in float32, summed token loss / total
non-ignored tokens of the step (plus, for MoE with output_router_logits, router_aux_loss_coef x HF's aux
loss of each micro-batch, averaged over the micro-batches), clip_grad_norm_ (active on every step),
torch.optim.AdamW. Tolerances: rtol 1e-4 on loss, gradient norm, every gradient and every weight after 3
steps (atol 1e-6 on gradients, 1e-5 on weights, for entries that are zero or cancel).
"""

import json

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open

from horizon_ray.engine import Engine, EngineConfig, LoraConfig, ModelConfig
from horizon_ray.engine.model import EXPERT_TARGETS
from tests.tiny import FAMILY_BUILDERS, V, named_tensors, peft_reference, peft_trainable, random_batches, reference_step

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
FAMILIES = list(FAMILY_BUILDERS)
MOE = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")


def _build(family, tmp_path, name="model", **kw):
    path, cls = FAMILY_BUILDERS[family](tmp_path, name, **kw)
    return path, cls


def _reference(cls, path):
    """The HF model, with the plain loop over experts (not a grouped kernel) for MoE families."""
    kw = {"experts_implementation": "eager"} if "Moe" in cls.__name__ or "Mixtral" in cls.__name__ else {}
    return cls.from_pretrained(path, **kw).float()


def _as_hf_params(eng, kind):
    """The engine's tensors of one kind under the names of the HF model's parameters: a MoE layer's experts
    as HF's stacked gate_up_proj [E, 2W, H] and down_proj [E, H, W], Mixtral's block_sparse_moe as mlp."""
    out = {}
    for u in eng.store.units:
        flat = getattr(u, kind)
        views = u.layout.views(flat)
        for t in u.layout.tensors:
            if t.key in views:
                out[t.name.replace(".block_sparse_moe.", ".mlp.")] = views[t.key]
        for key, _, _ in u.layout.stacks:
            layer = u.layout.name.split(".")[1]
            out[f"model.layers.{layer}.mlp.{key}_proj"] = views[key]
    return out


def _train_against_hf(path, cls, K, steps=3, micro=2, max_norm=0.5, **batch):
    ref = _reference(cls, path)
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=max_norm, checkpoint_every=K, device="cpu",
                                                    compute_dtype="float32"))
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    params = dict(ref.named_parameters())
    clipped, history = 0, []
    for step, mbs in enumerate(random_batches(steps, micro=micro, **batch)):
        loss = eng.train_step(mbs)
        ref_loss, ref_norm, ref_grads = reference_step(ref, params, opt, mbs, max_norm,
                                                       aux_coef=eng.model.router_aux_coef)
        history.append(ref_grads)
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert eng.last_grad_norm == pytest.approx(ref_norm, rel=1e-4)
        clipped += ref_norm > max_norm
        eng.close()  # the update runs in the background; afterwards the host holds the clipped gradients
        grads = _as_hf_params(eng, "grad")
        assert set(grads) | {"lm_head.weight"} >= set(params), set(params) - set(grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"grad {name}, step {step}")
    assert clipped == steps
    eng.close()
    masters = _as_hf_params(eng, "master")
    excused = total = 0
    for name, p in ref.named_parameters():
        if name == "lm_head.weight" and ref.config.tie_word_embeddings:
            continue
        excused += _assert_weights_close(masters[name], p.detach(), [g[name] for g in history], name)
        total += p.numel()
    assert excused / total < 0.01  # as tests/tiny.py allows (3 steps: ~0.3 % of Gaussian gradients)
    return eng, ref


def _assert_weights_close(got, want, grads, name, lr=HP["lr"]):
    """rtol 1e-4, except where some step's gradient was roundoff (below 1e-3 of its row's RMS gradient, not an
    exact zero; by row, as a fused qkv_proj's k rows have gradients far smaller than its v rows): AdamW moves
    such a weight by about lr whatever the gradient's size, so the two sides may differ by up to lr a step
    there (tests/tiny.py, assert_close_but_adam_roundoff, says more). Returns how many elements were so
    excused (they must stay rare)."""
    tiny = torch.zeros_like(want, dtype=torch.bool)
    for g in grads:
        rms = g.square().mean(-1, keepdim=g.dim() > 1).sqrt()
        tiny |= (g != 0) & (g.abs() < 1e-3 * rms)
    torch.testing.assert_close(got[~tiny], want[~tiny], rtol=1e-4, atol=1e-5, msg=f"weight {name}")
    assert not tiny.any() or (got[tiny] - want[tiny]).abs().max() <= lr * len(grads), name
    return int(tiny.sum())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("K", [1, 2])
def test_matches_hf_and_adamw_fp32(tmp_path, family, K):
    _train_against_hf(*_build(family, tmp_path), K)


def test_moe_without_the_aux_loss_trains_on_the_cross_entropy_alone(tmp_path):
    """output_router_logits false: no load-balancing term (HF computes none), and a different step than with it."""
    path, cls = _build("qwen3_moe", tmp_path, output_router_logits=False, norm_topk_prob=False)
    # (the default batches give one embedding element a roundoff gradient in step 1, 1e-6 of its row's, which
    # AdamW turns into a 1e-4 step on one side and another on the other: that difference, not the math, then
    # moves step 3's gradients by 3e-4; these batches have no such element)
    eng, _ = _train_against_hf(path, cls, K=2, seed=2)
    assert eng.model.router_aux_coef == 0 and not eng.model.norm_topk_prob


def test_an_expert_without_tokens_still_gets_its_adamw_step(tmp_path):
    """16 experts, top-1, 6 tokens a step: most experts see no token. torch.optim.AdamW steps them with a zero
    gradient (weight decay, and the moments of earlier steps); so must the engine, and it does."""
    path, cls = _build("qwen3_moe", tmp_path, num_experts=16, num_experts_per_tok=1, output_router_logits=False)
    before = Engine.from_pretrained(path, EngineConfig(device="cpu"))
    start = _as_hf_params(before, "master")
    eng, _ = _train_against_hf(path, cls, K=1, steps=2, micro=1, B=1, T=6)
    after = _as_hf_params(eng, "master")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    idle = [e for e in range(16) if not _as_hf_params(eng, "grad")[name][e].any()]
    assert len(idle) >= 8  # the last step's gradient of most experts is zero ...
    for e in idle:  # ... and they moved all the same
        assert not torch.equal(after[name][e], start[name][e])


@pytest.mark.parametrize(("family", "kw", "moe_layers", "seed"), [
    ("qwen3_moe", {"mlp_only_layers": [0], "num_hidden_layers": 3}, (1, 2), 1),
    # (seed 1's batches give two embedding elements a roundoff gradient in an early step, which AdamW turns into
    # different steps on the two sides, moving step 3's gradients there by 2.7e-6: the effect
    # test_moe_without_the_aux_loss_trains_on_the_cross_entropy_alone describes; these batches have none)
    ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4}, (1, 3), 2),
    ("qwen2_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, (1,), 1),
])
def test_dense_and_moe_layers_in_one_model_match_hf_and_peft(tmp_path, family, kw, moe_layers, seed):
    """Layers that differ in their MLP (HF's mlp_only_layers, decoder_sparse_step): each unit is its own layer's
    layout, the load-balancing loss counts only the MoE layers' rows (as HF's), LoRA adapts the experts of the MoE
    layers and the attention of all."""
    path, cls = _build(family, tmp_path, "base", **kw)
    eng, _ = _train_against_hf(path, cls, K=2, seed=seed)
    assert eng.model.moe_layers == moe_layers
    sizes = {u.layout.name: u.layout.numel for u in eng.store.units}
    assert sizes["layer.0"] < sizes[f"layer.{moe_layers[0]}"]
    lora = LoraConfig(r=4, alpha=8, targets=("v_proj", "experts.gate_up_proj", "experts.down_proj"))
    ref, init = _peft(cls, path, lora, tmp_path)
    params = _trainable(ref)
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=0.05, device="cpu", compute_dtype="float32",
                                                    lora=lora))
    eng.load_adapter(init)
    assert set(_adapters(eng)) == set(params)
    assert not any(".layers.0.mlp" in name for name in params)  # the dense layer has no expert adapter
    opt = torch.optim.AdamW(params.values(), **HP)
    for mbs in random_batches(2, micro=2):
        loss = eng.train_step(mbs)
        ref_loss, _, ref_grads = reference_step(ref, params, opt, mbs, 0.05, aux_coef=eng.model.router_aux_coef)
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        eng.close()
        for name, g in _adapters(eng, "grad").items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_aux_loss_is_per_micro_batch_whatever_its_row_groups(tmp_path):
    """layer_chunk_tokens splits each micro-batch into row groups (one row each here): the load-balancing loss
    still counts each micro-batch's routing as a whole, so the step does not change."""
    path, _ = _build("mixtral", tmp_path)
    batches = random_batches(2, micro=2, B=3)
    results = []
    for chunk in (1 << 20, 12):
        eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", layer_chunk_tokens=chunk))
        losses = [eng.train_step(mbs) for mbs in batches]
        eng.close()
        results.append((losses, torch.cat([u.master for u in eng.store.units])))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_keeps_the_hf_layout_and_loads_in_transformers(tmp_path, family):
    path, cls = _build(family, tmp_path)
    eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", max_shard_bytes=60_000))
    for mbs in random_batches(2, micro=1):
        eng.train_step(mbs)
    out = eng.save_pretrained(tmp_path / "out")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert set(index) == set(f.keys())  # the checkpoint's own names: fused stays fused, experts apart
    loaded = _reference(cls, out).eval()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(eng.forward_logits(ids), loaded(input_ids=ids).logits.float(), rtol=1e-5, atol=1e-5)
    again = Engine.from_pretrained(out, EngineConfig(device="cpu"))
    assert torch.equal(torch.cat([u.master for u in again.store.units]), torch.cat([u.master for u in eng.store.units]))


# ---- LoRA against PEFT ------------------------------------------------------------------------------------

TARGETS = {
    "qwen3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gemma2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gemma3": ("q_proj", "v_proj", "o_proj", "down_proj"),
    "mixtral": ("q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"),
    "qwen3_moe": ("k_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"),
    "olmoe": ("q_proj", "experts.down_proj"),
    "qwen2_moe": ("q_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"),
}
# norms trained beside the adapters (PEFT's modules_to_save): "norm" selects Qwen3's q_norm / k_norm too,
# and every one of Gemma's four layer norms
SAVED = {"qwen3": ("norm",), "gemma2": ("norm",), "gemma3": ("pre_feedforward_layernorm", "k_norm"),
         "phi3": ("input_layernorm",), "qwen2_moe": ("post_attention_layernorm",)}


def _peft(cls, path, lora: LoraConfig, tmp_path):
    """The reference PEFT model (the experts through target_parameters), and its initial adapter saved for the
    engine to load, with a random B so that A has a gradient from the first step."""
    return peft_reference(_reference(cls, path), lora, tmp_path, expert_targets=EXPERT_TARGETS)


def _adapters(eng, kind="master"):
    return named_tensors(eng.store.adapters, kind)


_trainable = peft_trainable


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_matches_peft_and_adamw_fp32(tmp_path, family):
    path, cls = _build(family, tmp_path, "base")
    lora = LoraConfig(r=4, alpha=8, targets=TARGETS[family], modules_to_save=SAVED.get(family, ()))
    ref, init = _peft(cls, path, lora, tmp_path)
    params = _trainable(ref)
    max_norm = 0.05
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=max_norm, checkpoint_every=2, device="cpu",
                                                    compute_dtype="float32", lora=lora))
    eng.load_adapter(init)
    assert set(_adapters(eng)) == set(params)
    opt = torch.optim.AdamW(params.values(), **HP)
    for step, mbs in enumerate(random_batches(3, micro=2)):
        loss = eng.train_step(mbs)
        ref_loss, ref_norm, ref_grads = reference_step(ref, params, opt, mbs, max_norm,
                                                       aux_coef=eng.model.router_aux_coef)
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert eng.last_grad_norm == pytest.approx(ref_norm, rel=1e-4)
        assert ref_norm > max_norm
        eng.close()
        for name, g in _adapters(eng, "grad").items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"grad {name}, step {step}")
    for name, p in _adapters(eng).items():
        torch.testing.assert_close(p, params[name].detach(), rtol=1e-4, atol=1e-5, msg=f"weight {name}")

    # the saved adapter gives PEFT the engine's logits; the merged model gives transformers the same
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(9))
    mine = eng.forward_logits(ids)
    out = eng.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_reference(cls, path), out).eval()
    torch.testing.assert_close(mine, loaded(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5)
    merged = _reference(cls, eng.save_merged(tmp_path / "merged")).eval()
    torch.testing.assert_close(mine, merged(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5)
    again = Engine.from_pretrained(out, EngineConfig(device="cpu", compute_dtype="float32"))
    assert set(again.lora.targets) == set(lora.targets)
    torch.testing.assert_close(again.forward_logits(ids), mine, rtol=0, atol=0)


# ---- refusals ---------------------------------------------------------------------------------------------


def test_lora_targets_outside_the_family_are_refused_by_name(tmp_path):
    phi, _ = _build("phi3", tmp_path, "phi")
    with pytest.raises(ValueError, match="its checkpoint fuses them: target qkv_proj and gate_up_proj"):
        Engine.from_pretrained(phi, EngineConfig(device="cpu", lora=LoraConfig(targets=("q_proj", "v_proj"))))
    moe, _ = _build("mixtral", tmp_path, "moe")
    with pytest.raises(ValueError, match="mixture of experts: target experts.gate_up_proj"):
        Engine.from_pretrained(moe, EngineConfig(device="cpu", lora=LoraConfig(targets=("gate_proj",))))
    with pytest.raises(ValueError, match="without dropout"):
        Engine.from_pretrained(moe, EngineConfig(device="cpu", lora=LoraConfig(
            dropout=0.1, targets=("q_proj", "experts.down_proj"))))
    shared, _ = _build("qwen2_moe", tmp_path, "qwen2_moe")
    with pytest.raises(ValueError, match="shared expert's projections answer to the same names"):
        Engine.from_pretrained(shared, EngineConfig(device="cpu", lora=LoraConfig(targets=("q_proj", "gate_proj"))))
    with pytest.raises(ValueError, match="train nothing in layer 0"):  # its dense layer has no experts
        Engine.from_pretrained(shared, EngineConfig(device="cpu", lora=LoraConfig(targets=("experts.down_proj",))))
    llama_like, _ = _build("qwen3", tmp_path, "qwen3")
    with pytest.raises(ValueError, match="not projections of this qwen3 model"):
        Engine.from_pretrained(llama_like, EngineConfig(device="cpu", lora=LoraConfig(targets=("qkv_proj",))))


BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 100}


@pytest.mark.parametrize(("config", "needle"), [
    ({"model_type": "gemma3"}, "vision-language checkpoint .* Gemma3ForCausalLM"),
    ({"model_type": "qwen2_moe", "use_sliding_window": True}, "use_sliding_window=True"),
    ({"model_type": "qwen2_moe", "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"model_type": "phimoe"}, "Phi-3.5-MoE is not supported"),
    ({"model_type": "gpt_oss"}, "model_type 'gpt_oss' is not supported; supported: .*'qwen3_moe'"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                             "long_factor": [1.0] * 8}}, "rope type 'longrope'"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"model_type": "phi3", "resid_pdrop": 0.1}, "resid_pdrop=0.1: residual dropout"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "Gemma 3 does not cap attention"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": 1}, "mlp_only_layers=1: must be a list"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8}, "num_experts_per_tok=8"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router jitter"),
    ({"model_type": "olmoe", "clip_qkv": 8.0}, "clip_qkv"),
    ({"model_type": "llama", "layer_types": ["sliding_attention", "full_attention"]}, "only full_attention"),
])
def test_unsupported_families_and_fields_are_refused_by_name(config, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf({**BASE, **config})


def test_family_fields_are_read_as_hf_reads_them():
    """Layer patterns and RoPE from configs as the hub ships them (legacy keys), not only as transformers v5
    writes them."""
    gemma3 = ModelConfig.from_hf({**BASE, "model_type": "gemma3_text", "num_hidden_layers": 12, "head_dim": 16,
                                  "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6,
                                  "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                  "query_pre_attn_scalar": 168})
    assert [t[0] for t in gemma3.layer_types] == list("sssssfsssssf")
    assert (gemma3.rope_theta, gemma3.rope_linear, gemma3.local_rope_theta) == (1e6, 8.0, 1e4)
    assert gemma3.attn_scale == 168**-0.5 and gemma3.tie_word_embeddings and gemma3.norm_offset == 1.0
    gemma2 = ModelConfig.from_hf({**BASE, "model_type": "gemma2", "num_hidden_layers": 4, "head_dim": 16})
    assert [t[0] for t in gemma2.layer_types] == list("sfsf")
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.sliding_window) == (50.0, 30.0, 4096)  # HF's defaults
    qwen3 = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "num_hidden_layers": 4, "use_sliding_window": True,
                                 "sliding_window": 8, "max_window_layers": 2})
    assert qwen3.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert ModelConfig.from_hf({**BASE, "model_type": "qwen3", "sliding_window": 8}).sliding_window is None
    mixtral = ModelConfig.from_hf({**BASE, "model_type": "mixtral", "num_local_experts": 8})
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.norm_topk_prob, mixtral.router_aux_coef) == \
        (8, 2, True, 0.0)
    hub_qwen3_moe = ModelConfig.from_hf({**BASE, "model_type": "qwen3_moe", "num_experts": 128,
                                         "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                         "norm_topk_prob": True, "output_router_logits": True})
    assert (hub_qwen3_moe.num_experts, hub_qwen3_moe.router_aux_coef) == (128, 0.001)


def test_the_padding_tokens_row_gets_no_gradient_as_in_hf(tmp_path):
    """HF's embeddings are nn.Embedding(padding_idx=pad_token_id): lookups of the padding token give its row no
    gradient (a zero row would otherwise get 1/sqrt(eps) through the first norm). Every family, Llama included."""
    from tests.tiny import tiny_llama

    path, cls = tiny_llama(tmp_path, pad_token_id=5)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    ids[0, 3:6] = 5
    mbs = [(ids, ids.clone())]
    ref = cls.from_pretrained(path).float()
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=None, device="cpu"))
    assert eng.model.padding_idx == 5
    eng.train_step(mbs)
    eng.close()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    _, _, grads = reference_step(ref, dict(ref.named_parameters()), opt, mbs, 1e9)
    mine = _as_hf_params(eng, "grad")["model.embed_tokens.weight"]
    assert not mine[5].any() and not grads["model.embed_tokens.weight"][5].any()
    torch.testing.assert_close(mine, grads["model.embed_tokens.weight"], rtol=1e-4, atol=1e-6)


# ---- the new kernels against plain autograd -----------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_softcap_attention_matches_plain_autograd_across_blocks(monkeypatch, masked):
    """The blockwise soft-capped attention (blocks of 3 queries here) against the eager math under autograd in
    float64: grouped-query heads, a causal or a packed and windowed mask."""
    from horizon_ray.engine import kernels
    from horizon_ray.engine.layers import attention_mask

    monkeypatch.setattr(kernels, "_SOFTCAP_BLOCK_ELEMENTS", 2 * 4 * 10 * 3)  # B x heads x T x 3 queries
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, d, cap, scale = 2, 4, 2, 10, 8, 0.7, 0.3
    q, k, v = (torch.randn(B, h, T, d, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    pos = torch.cat([torch.arange(6), torch.arange(4)])[None].expand(B, T) if masked else None
    mask = attention_mask(pos, T, 4 if masked else None, "cpu")
    go = torch.randn(B, Hq, T, d, generator=g, dtype=torch.float64)

    def plain(q, k, v):
        s = torch.matmul(q, k.repeat_interleave(Hq // Hkv, 1).transpose(-2, -1)) * scale
        s = torch.tanh(s / cap) * cap
        allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool).tril()
        s = s.masked_fill(~allowed, float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v.repeat_interleave(Hq // Hkv, 1))

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernels.softcap_attention(*leaves, mask, scale, cap)
    mine = torch.autograd.grad(out, leaves, go)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = plain(*ref_leaves)
    ref = torch.autograd.grad(ref_out, ref_leaves, go)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    with torch.no_grad():
        torch.testing.assert_close(kernels.softcap_attention(q, k, v, mask, scale, cap), ref_out.detach())


def test_expert_linear_runs_each_expert_once_and_accumulates_its_gradient():
    """Rows sorted by expert, one expert without rows: the output, dL/dx, dL/dW (for stacked LoRA factors) and
    the sink's accumulated dW equal a loop over the rows; the idle expert's gradient is exactly zero."""
    from horizon_ray.engine.kernels import expert_linear

    g = torch.Generator().manual_seed(0)
    E, I, O = 4, 8, 16
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, I, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(E, O, I, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.ones(E, O, I, dtype=torch.float64)  # accumulates on top of what is there
    gy = torch.randn(10, O, generator=g, dtype=torch.float64)
    y = expert_linear(x, w, counts, sink)
    gx, gw = torch.autograd.grad(y, [x, w], gy)
    owner = torch.repeat_interleave(torch.arange(E), counts)
    want = torch.stack([w[e] @ x[i] for i, e in enumerate(owner.tolist())]).detach()
    torch.testing.assert_close(y.detach(), want)
    torch.testing.assert_close(gx, torch.stack([gy[i] @ w[e] for i, e in enumerate(owner.tolist())]).detach())
    want_gw = torch.zeros(E, O, I, dtype=torch.float64)
    for i, e in enumerate(owner.tolist()):
        want_gw[e] += torch.outer(gy[i], x[i].detach())
    torch.testing.assert_close(gw, want_gw)
    torch.testing.assert_close(sink, 1 + want_gw)
    assert not gw[1].any()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_compute_close_to_fp32_reference(tmp_path, family):
    """bf16 compute against the fp32 reference (loss rtol 3e-2, as for Llama): the families' casts hold up."""
    path, cls = _build(family, tmp_path)
    ref = _reference(cls, path)
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=1.0, checkpoint_every=2, device="cpu",
                                                    compute_dtype="bfloat16"))
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    for mbs in random_batches(3, micro=2):
        loss = eng.train_step(mbs)
        ref_loss, ref_norm, _ = reference_step(ref, dict(ref.named_parameters()), opt, mbs, 1.0,
                                               aux_coef=eng.model.router_aux_coef)
        assert loss == pytest.approx(ref_loss, rel=3e-2)
        assert eng.last_grad_norm == pytest.approx(ref_norm, rel=5e-2)
    eng.close()


@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_update_modes_on_the_new_families(tmp_path, family):
    """The update modes know nothing of the layer inside a unit: speculative without clipping is bit-identical
    to exact (a MoE layer's experts, Gemma's norms and all), delayed trains."""
    path, _ = _build(family, tmp_path)
    batches = random_batches(3, micro=2)
    runs = {}
    for update in ("exact", "speculative", "delayed"):
        eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=1e6, device="cpu",
                                                        compute_dtype="bfloat16", update=update))
        losses = [eng.train_step(mbs) for mbs in batches]
        eng.close()  # the last update runs in the background
        runs[update] = (losses, torch.cat([u.master for u in eng.store.units]))
    assert runs["speculative"][0] == runs["exact"][0]
    assert torch.equal(runs["speculative"][1], runs["exact"][1])
    assert runs["delayed"][0][0] == runs["exact"][0][0] and runs["delayed"][0][1] != runs["exact"][0][1]


@pytest.mark.parametrize("family", ["mixtral", "gemma2"])
def test_two_ranks_match_one_process_with_all_their_micro_batches(family):
    """Several ranks over one host store (engine/ranks.py): the load-balancing loss averages over every rank's
    micro-batches, as one process with all of them does; Gemma's layers know nothing of ranks."""
    from tests.unit.test_engine_ranks import MICRO, WORLD, _run_ranks

    config = {"hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": V, "head_dim": 16, "tie_word_embeddings": False,
              **({"model_type": "mixtral", "num_local_experts": 4, "output_router_logits": True,
                  "router_aux_loss_coef": 0.1} if family == "mixtral" else
                 {"model_type": "gemma2", "sliding_window": 6, "attn_logit_softcapping": 0.5})}
    cfg = EngineConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, seed=0)
    batches = random_batches(2, WORLD * MICRO, T=16)
    ref = Engine.from_config(config, cfg)
    want = [(ref.train_step(mbs), ref.last_grad_norm) for mbs in batches]
    ref.synchronize()
    ranks, store = _run_ranks(config, cfg, batches)
    for rank, got, _ in ranks:
        for (lg, ng), (lw, nw) in zip(got, want):
            assert lg == pytest.approx(lw, rel=1e-5) and ng == pytest.approx(nw, rel=1e-5), rank
    for a, b in zip(store.trained, ref.store.trained):
        torch.testing.assert_close(a.master.float(), b.master.float(), rtol=1e-4, atol=1e-6)
    ref.close()


@pytest.mark.parametrize(("family", "kw"), [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("phi3", {"sliding_window": 4}),
    ("mixtral", {"sliding_window": 4}),
    ("gemma3", {"sliding_window": 3}),
])
def test_sliding_windows_match_hf(tmp_path, family, kw):
    """Windows shorter than the sequence, on the layers the family slides (Qwen3: from max_window_layers on)."""
    path, cls = _build(family, tmp_path, **kw)
    eng = Engine.from_pretrained(path, EngineConfig(device="cpu"))
    assert eng.model.sliding_window == kw["sliding_window"]
    ref = _reference(cls, path).eval()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(eng.forward_logits(ids), ref(input_ids=ids).logits.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3_moe"])
def test_packed_documents_do_not_attend_across(tmp_path, family):
    """Packing (position_ids restarting at 0) on sliding and global layers, the capped attention included."""
    path, _ = _build(family, tmp_path)
    eng = Engine.from_pretrained(path, EngineConfig(device="cpu"))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, V, (1, 9), generator=g), torch.randint(3, V, (1, 7), generator=g)
    positions = torch.cat([torch.arange(9), torch.arange(7)])[None]
    logits = eng.forward_logits(torch.cat([a, b], dim=1), positions)
    torch.testing.assert_close(logits[:, :9], eng.forward_logits(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, 9:], eng.forward_logits(b), rtol=1e-5, atol=1e-5)


def test_a_row_groups_tables_are_built_on_the_device_that_reads_them(tmp_path, monkeypatch):
    """RoPE tables and masks are computed where the layers read them: built on the host, each row group's
    cos and sin left the GPU idle while the host computed them, then crossed as pageable copies (qwen3-4b on
    the H200: 0.065 s of a 4.04 s step in gaps between those copies). The meta device stands for the GPU."""
    from horizon_ray.engine import layers

    path, _ = _build("gemma2", tmp_path, sliding_window=4)  # sliding and global layers: two tables, two masks
    eng = Engine.from_pretrained(path, EngineConfig(device="cpu"))
    built_on: list[str] = []
    rope, mask = layers.rope_tables, layers.attention_mask

    def recording_rope(inv_freq, pos, dtype):
        built_on.append(pos.device.type)
        return rope(inv_freq, pos, dtype)

    def recording_mask(*a, **kw):
        m = mask(*a, **kw)
        built_on.append(m.device.type)
        return m

    monkeypatch.setattr(layers, "rope_tables", recording_rope)
    monkeypatch.setattr(layers, "attention_mask", recording_mask)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(9), torch.arange(7)]).expand(2, 16)  # packed: both kinds get a mask
    mb = eng.template.micro_batch(ids, ids, pos, pos, torch.device("meta"), torch.bfloat16)
    assert built_on == ["meta"] * 4
    assert mb.cos_BTd.is_meta and mb.mask_B1TT.is_meta and mb.n_targets == 32
