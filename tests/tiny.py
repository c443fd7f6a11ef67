"""Tiny HF models and random batches that the engine's numerics tests build for themselves."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

V = 97  # vocabulary of the tiny models


def tiny_llama(tmp_path, name="model", **kw):
    """Llama with untied embeddings and grouped-query attention, saved in fp32; (path, class)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False, **kw)
    return save(LlamaForCausalLM(cfg), tmp_path, name)


def tiny_qwen2(tmp_path, name="model"):
    """Qwen2 with tied embeddings, q/k/v biases and one kv head, saved in fp32; (path, class)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=V, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # HF initialises biases to zero: give them values so that they are tested
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0, 0.02)
    return save(model, tmp_path, name)


def _varied(model, offset_norms=False, seed=0):
    """Norm weights away from their initial value (1, or 0 for Gemma's (1 + w) norms) and biases away from 0,
    so that their gradients and the template's use of them are tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if offset_norms else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.normal_(0, 0.02, generator=g)
    return model


# The families beyond Llama / Qwen2 / Mistral, each tiny, in fp32, with what sets it apart switched on.
# Sizes are multiples of 8 (the expert GEMMs' layout rule on CUDA).
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_qwen3(tmp_path, name="model", **kw):
    """Qwen3: per-head q/k RMSNorm, an explicit head_dim (24, not hidden / heads = 16), no q/k/v bias."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, vocab_size=V, tie_word_embeddings=False, **_IDS, **kw)
    return save(_varied(Qwen3ForCausalLM(cfg)), tmp_path, name)


def tiny_phi3(tmp_path, name="model", **kw):
    """Phi-3 / Phi-4: q/k/v fused in qkv_proj and gate/up in gate_up_proj (on disk and in the unit)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False, **_IDS, **kw)
    return save(_varied(Phi3ForCausalLM(cfg)), tmp_path, name)


def tiny_gemma2(tmp_path, name="model", **kw):
    """Gemma 2: (1 + w) norms around attention and the MLP, GELU-tanh, scaled embeddings, query_pre_attn_scalar,
    even layers sliding (window 5 of 12 tokens), attention and final logits soft-capped tightly enough that the
    caps bend the numbers."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    kw = {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.0, "sliding_window": 5, **kw}
    cfg = Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=V, query_pre_attn_scalar=24, **_IDS, **kw)
    return save(_varied(Gemma2ForCausalLM(cfg), offset_norms=True), tmp_path, name)


def tiny_gemma3(tmp_path, name="model", **kw):
    """Gemma 3 (text): Gemma 2's layer with q/k norms and no attention cap, sliding and global layers with their
    own RoPE (the global ones interpolated by 4), a final logit cap."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    kw = {"final_logit_softcapping": 1.0, "rope_parameters": rope, "sliding_window": 5, **kw}
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=V, query_pre_attn_scalar=24,
                           layer_types=["sliding_attention", "full_attention"] * 2, **_IDS, **kw)
    return save(_varied(Gemma3ForCausalLM(cfg), offset_norms=True), tmp_path, name)


def tiny_mixtral(tmp_path, name="model", **kw):
    """Mixtral: 4 experts, top-2 (renormalised), the router's load-balancing loss switched on with a weight
    large enough to move the numbers."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    kw = {"output_router_logits": True, "router_aux_loss_coef": 0.1, **kw}
    cfg = MixtralConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False, num_local_experts=4,
                        num_experts_per_tok=2, **_IDS, **kw)
    return save(_varied(MixtralForCausalLM(cfg)), tmp_path, name)


def tiny_qwen3_moe(tmp_path, name="model", **kw):
    """Qwen3-MoE: 8 experts of width 32, top-2 renormalised (norm_topk_prob), q/k norms, the aux loss on."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    kw = {"output_router_logits": True, "router_aux_loss_coef": 0.05, "norm_topk_prob": True, "num_experts": 8,
          "num_experts_per_tok": 2, "num_hidden_layers": 2, **kw}
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=V, tie_word_embeddings=False, **_IDS, **kw)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # HF initialises the router at zero: every token would tie
        for name_, p in model.named_parameters():
            if name_.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return save(_varied(model), tmp_path, name)


def tiny_olmoe(tmp_path, name="model", **kw):
    """OLMoE: q/k norms over the whole projection, 8 experts, top-2 not renormalised, the aux loss on."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    kw = {"output_router_logits": True, "router_aux_loss_coef": 0.05, **kw}
    cfg = OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=V, num_experts=8, num_experts_per_tok=2,
                      tie_word_embeddings=False, **_IDS, **kw)
    model = OlmoeForCausalLM(cfg)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return save(_varied(model), tmp_path, name)


def tiny_qwen2_moe(tmp_path, name="model", **kw):
    """Qwen2-MoE: q/k/v biases, a dense first layer (mlp_only_layers) and then MoE layers of 8 experts of width 32,
    top-2 not renormalised, each with a shared expert of width 48 under its sigmoid gate; the aux loss on."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    kw = {"output_router_logits": True, "router_aux_loss_coef": 0.05, "num_experts": 8, "num_experts_per_tok": 2,
          "mlp_only_layers": [0], **kw}
    cfg = Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False, **_IDS, **kw)
    model = Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():  # a router of std 0.02 would route every token alike; the shared gate's likewise
        for name_, p in model.named_parameters():
            if name_.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
    return save(_varied(model), tmp_path, name)


FAMILY_BUILDERS = {"qwen3": tiny_qwen3, "phi3": tiny_phi3, "gemma2": tiny_gemma2, "gemma3": tiny_gemma3,
                   "mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe, "olmoe": tiny_olmoe,
                   "qwen2_moe": tiny_qwen2_moe}


def save(model, tmp_path, name="model"):
    path = tmp_path / name
    model.float().save_pretrained(path)
    return path, type(model)


def llama_config(layers, hidden=64, inter=96, vocab=V, heads=4, kv=2, tied=False) -> dict:
    """An HF config.json (as a dict) of a Llama shape, for Engine.from_config."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied, "rms_norm_eps": 1e-6}


def llama_checkpoint(path, config: dict):
    """An HF Llama of ``config`` (llama_config's dict) with HF's random initialisation (seed 0), saved in fp32 at
    ``path``; returns ``path``."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_dict(config)).save_pretrained(path)
    return path


def bnb_prequantized(model_dir, out_dir, quantize: str, device: str):
    """``model_dir`` (fp32) quantized by transformers + BitsAndBytesConfig on ``device`` (bitsandbytes' kernels
    there; QLoRA's nf4 or fp4 with double quantization, or LLM.int8) and saved pre-quantized (bitsandbytes' HF
    serialization) at ``out_dir``, from fp32 so that its quant state is fp32; returns ``out_dir``."""
    from transformers import BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_8bit=True) if quantize == "int8" else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quantize, bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)
    LlamaForCausalLM.from_pretrained(model_dir, quantization_config=q, device_map=device,
                                     dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


def random_batches(steps, micro, B=2, T=12, seed=1, prompt=3, vocab=V):
    """`steps` lists of `micro` (input_ids, labels) pairs; the first `prompt` labels of a row are ignored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(micro):
            ids = torch.randint(0, vocab, (B, T), generator=g)
            labels = ids.clone()
            labels[:, :prompt] = -100
            mbs.append((ids, labels))
        out.append(mbs)
    return out


def preference_batches(steps: int, micro: int, pairs: int, seed: int = 3, T: int = 14):
    """`steps` lists of `micro` micro-batches of `pairs` pairs each: (ids, labels, completion mask), rows 2i
    chosen and 2i+1 rejected, one prompt per pair, completions of different lengths, right-padded with 0.
    Kept here, not beside the TRL reference, so that the GPU tests need no TRL."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(micro):
            ids = torch.zeros(2 * pairs, T, dtype=torch.long)
            mask = torch.zeros(2 * pairs, T, dtype=torch.long)
            for p in range(pairs):
                n_prompt = int(torch.randint(2, 5, (1,), generator=g))
                prompt = torch.randint(1, V, (n_prompt,), generator=g)
                for r in (2 * p, 2 * p + 1):
                    n = int(torch.randint(3, T - n_prompt + 1, (1,), generator=g))
                    ids[r, :n_prompt] = prompt
                    ids[r, n_prompt:n_prompt + n] = torch.randint(1, V, (n,), generator=g)
                    mask[r, n_prompt:n_prompt + n] = 1
            labels = ids.masked_fill(mask == 0, -100)
            mbs.append((ids, labels, mask))
        out.append(mbs)
    return out


def reference_step(model, params: dict, opt, mbs, max_norm, aux_coef: float = 0.0):
    """One step of the HF reference: summed token CE / the step's target count, backward per micro-batch,
    clip_grad_norm_ over ``params`` (name -> parameter), opt.step(). Returns (loss, norm, clipped grads).
    ``aux_coef``: a MoE model's load-balancing loss (HF's aux_loss of each forward call) weighted by it and
    averaged over the micro-batches is added, as the engine defines the step's loss."""
    import torch.nn.functional as F

    n = sum(int((lab[:, 1:] != -100).sum()) for _, lab in mbs)
    opt.zero_grad()
    total = 0.0
    for ids, lab in mbs:
        out = model(input_ids=ids, output_router_logits=True) if aux_coef else model(input_ids=ids)
        logits = out.logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum") / n
        if aux_coef:
            loss = loss + aux_coef * out.aux_loss / len(mbs)
        loss.backward()
        total += loss.item()
    norm = float(torch.nn.utils.clip_grad_norm_(params.values(), max_norm))
    grads = {k: p.grad.clone() for k, p in params.items()}  # clipped, as the engine leaves them
    opt.step()
    return total, norm, grads


# A tiny Llama over the demo tokenizer's 262 ids, for end-to-end job tests.
JOB_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 262, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "initializer_range": 0.02,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def demo_model(path):
    """JOB_LLAMA (random init, seed 7) saved at `path` with the demo tokenizer."""
    from horizon_ray.data import build_demo_tokenizer
    from horizon_ray.engine import Engine, EngineConfig

    eng = Engine.from_config(JOB_LLAMA, EngineConfig(device="cpu", seed=7))
    eng.save_pretrained(path)
    eng.close()
    build_demo_tokenizer(path)
    return path


def job_assets(root, n_examples: int):
    """`root/model` (demo_model) and `root/train.jsonl`."""
    from horizon_ray.data import make_demo_dataset

    demo_model(root / "model")
    make_demo_dataset(root / "train.jsonl", n_examples, seed=1)
    return root


def preference_assets(root, n_train: int, n_eval: int):
    """`root/model` (demo_model), `root/train.jsonl` and `root/eval.jsonl`: the demo's preference pairs, the
    eval prompts none of the training ones."""
    import json

    from horizon_ray.data import make_demo_preferences

    demo_model(root / "model")
    make_demo_preferences(root / "train.jsonl", n_train, seed=1)
    train_prompts = {json.loads(line)["prompt"][0]["content"] for line in open(root / "train.jsonl")}
    make_demo_preferences(root / "eval.jsonl", n_eval, seed=2, exclude=train_prompts)
    return root


def catalogue_model(bed):
    """A real model (demo_model) in an API testbed's catalogue as ``tiny-1g``, in place of the testbed's empty
    ``1GiB`` directory (the fake planner reads the size from that name); its path."""
    import shutil

    base = bed.root / "models" / "1GiB"
    shutil.rmtree(base)
    bed.settings.model_catalogue = {"tiny-1g": demo_model(base)}
    return base


def resumed_and_uninterrupted(path, cfg, batches):
    """(uninterrupted engine, engine resumed from a state saved halfway), both run over `batches`."""
    from horizon_ray.engine import Engine

    whole = Engine.from_pretrained(path, cfg)
    for mbs in batches:
        whole.train_step(mbs)
    half = len(batches) // 2
    first = Engine.from_pretrained(path, cfg)
    for mbs in batches[:half]:
        first.train_step(mbs)
    state = path.parent / "state"
    first.save_state(state)
    resumed = Engine.from_pretrained(path, cfg)
    resumed.load_state(state)
    assert resumed.step == half
    for mbs in batches[half:]:
        resumed.train_step(mbs)
    whole.close()
    resumed.close()
    return whole, resumed


def step_grads(eng) -> "torch.Tensor":
    """The trained units' gradients of the step just run, as the update read them (waits for it)."""
    eng.synchronize()
    return torch.cat([u.grad.float() for u in eng.store.trained]).clone()


def assert_close_but_adam_roundoff(got, want, units, grads, lr: float, rtol: float, atol: float = 1e-5,
                                   by_row: bool = False, roundoff: float = 1e-5):
    """Trained weights on two devices agree at rtol, plus what AdamW makes of the gradients' roundoff.

    AdamW moves a weight by lr x m_hat / (sqrt(v_hat) + eps): about lr whatever the gradient's size, once the
    gradient is well above eps. Two devices sum a gradient in different orders and agree to about ``roundoff``
    x the RMS gradient of its tensor; an element whose gradient g is small against that RMS gets a step that
    differs by up to lr x roundoff x RMS / |g| (all of lr where g is itself roundoff, a sum that cancels). So
    each element may differ by atol + rtol |want| + lr x sum over steps of min(1, roundoff x RMS / |g|), from
    ``grads``: the reference's per-step gradients of ``units`` (an exact zero, e.g. the embedding row of a
    token absent from the step, is zero on both and adds nothing); the elements that lean on that allowance
    (more than atol of it) must stay a small share. ``by_row``: against the RMS of the element's row instead
    (a fused qkv_proj's k rows have gradients far smaller than its v rows; one expert's rows than another's).
    """
    slack = torch.zeros_like(want, dtype=torch.float64)
    for g in grads:  # every step's share
        off = 0
        for unit in units:
            for t in unit.layout.tensors:
                part = g[off + t.offset: off + t.offset + t.numel].double()
                if by_row and len(t.shape) > 1:
                    rows = part.view(-1, t.shape[-1])
                    rms = rows.square().mean(-1, keepdim=True).sqrt().expand_as(rows).reshape(-1)
                else:
                    rms = part.square().mean().sqrt().expand_as(part)
                share = torch.where(part != 0, (roundoff * rms / part.abs()).clamp(max=1.0), 0.0)
                slack[off + t.offset: off + t.offset + t.numel] += lr * share
            off += unit.layout.numel
    err = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs() + slack
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (f"element {worst}: |{float(got[worst])} - {float(want[worst])}| = "
                                  f"{float(err[worst]):.3g} > {float(bound[worst]):.3g} (roundoff slack "
                                  f"{float(slack[worst]):.3g})")
    assert (slack > atol).double().mean() < 0.01


def named_tensors(units, kind: str = "master") -> dict:
    """HF's (or PEFT's saved) names -> views of the units' flat buffers of one kind (master, grad, ...)."""
    out = {}
    for u in units:
        views = u.layout.views(getattr(u, kind))
        for t in u.layout.tensors:
            out[t.name] = views[t.key]
    return out


def peft_reference(base, lora, tmp_path, random_b: bool = True, expert_targets=(), b_scale: float = 0.05):
    """The reference PEFT model over ``base`` for the engine's ``lora`` (targets among ``expert_targets`` through
    PEFT's target_parameters, as mlp.<name>), and its initial adapter saved for the engine to load; with a
    random B (``random_b``, normal times ``b_scale``) A has a gradient from the first step. Returns (model,
    adapter dir)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    modules = [t for t in lora.targets if t not in expert_targets]
    stacked = [f"mlp.{t}" for t in lora.targets if t in expert_targets]
    cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules,
                         target_parameters=stacked or None, modules_to_save=list(lora.modules_to_save) or None,
                         task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    if random_b:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * b_scale)
    model.save_pretrained(tmp_path / "init")
    model.train()
    return model, tmp_path / "init"


def peft_trainable(model) -> dict:
    """PEFT's trainable parameters by their saved names (the adapter name, and for a module to save its
    wrapper, dropped)."""
    return {n.replace(".modules_to_save.default", "").replace(".default", ""): p
            for n, p in model.named_parameters() if p.requires_grad}


def run_ranks(target, world: int, *args) -> list:
    """Run ``target(rank, rendezvous, *args, results)`` in ``world`` spawned processes (a file rendezvous: no port
    to find free and release, which another process may take in between) and return what each put on
    ``results``, sorted; every process must exit cleanly."""
    import tempfile

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        procs = [ctx.Process(target=target, args=(r, f"{tmp}/rendezvous", *args, results)) for r in range(world)]
        for p in procs:
            p.start()
        out = sorted(results.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    return out
