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


def save(model, tmp_path, name="model"):
    path = tmp_path / name
    model.float().save_pretrained(path)
    return path, type(model)


def llama_config(layers, hidden=64, inter=96, vocab=V, heads=4, kv=2, tied=False) -> dict:
    """An HF config.json (as a dict) of a Llama shape, for Engine.from_config."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied, "rms_norm_eps": 1e-6}


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


def reference_step(model, params: dict, opt, mbs, max_norm):
    """One step of the HF reference: summed token CE / the step's target count, backward per micro-batch,
    clip_grad_norm_ over ``params`` (name -> parameter), opt.step(). Returns (loss, norm, clipped grads)."""
    import torch.nn.functional as F

    n = sum(int((lab[:, 1:] != -100).sum()) for _, lab in mbs)
    opt.zero_grad()
    total = 0.0
    for ids, lab in mbs:
        logits = model(input_ids=ids).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum") / n
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


def job_assets(root, n_examples: int):
    """`root/model` (JOB_LLAMA, random init, with the demo tokenizer) and `root/train.jsonl`."""
    from horizon_ray.data import build_demo_tokenizer, make_demo_dataset
    from horizon_ray.engine import Engine, EngineConfig

    eng = Engine.from_config(JOB_LLAMA, EngineConfig(device="cpu", seed=7))
    eng.save_pretrained(root / "model")
    eng.close()
    build_demo_tokenizer(root / "model")
    make_demo_dataset(root / "train.jsonl", n_examples, seed=1)
    return root


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


def assert_close_but_adam_roundoff(got, want, units, grads, lr: float, rtol: float, atol: float = 1e-5):
    """Trained weights on two devices agree at rtol, except where AdamW normalises a gradient that is roundoff.

    AdamW moves a weight by lr x m_hat / (sqrt(v_hat) + eps): about lr whatever the gradient's size, once the
    gradient is well above eps. An element whose gradient in a step is tiny against its tensor's (a sum that
    cancels to the level of roundoff) is moved by lr x (a ratio of roundoffs) on each device, and the two can
    differ by up to lr in that step. Such elements (some step's |g| below 1e-3 of the tensor's RMS gradient,
    in ``grads``: the reference's per-step gradients of ``units``; an exact zero, e.g. the embedding row of a
    token absent from the step, is zero on both) may differ by at most lr x steps; every other element is held
    to rtol, and they must stay a small share.
    """
    tiny = torch.zeros_like(want, dtype=torch.bool)
    for g in grads:  # tiny in any step
        off = 0
        for unit in units:
            for t in unit.layout.tensors:
                part = g[off + t.offset: off + t.offset + t.numel]
                rms = part.square().mean().sqrt()
                tiny[off + t.offset: off + t.offset + t.numel] |= (part != 0) & (part.abs() < 1e-3 * rms)
            off += unit.layout.numel
    torch.testing.assert_close(got[~tiny], want[~tiny], rtol=rtol, atol=atol)
    assert not tiny.any() or (got[tiny] - want[tiny]).abs().max() <= lr * len(grads)
    assert tiny.float().mean() < 0.01
