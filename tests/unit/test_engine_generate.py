"""Generation on the engine (engine/generate.py) against HF generate and PEFT's generate, on the CPU.

Every family the engine trains, tiny and random (tests/tiny.py), in float32: the engine's greedy tokens equal
HF generate's token for token, for prompts of different lengths run as one left-padded batch on the engine
and one by one through HF, long enough to pass the sliding windows (Mistral's 6, Gemma's 5) and Gemma's caps.
"""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from horizon_ray.engine import decode_graphs
from horizon_ray.engine.decode_graphs import CAPTURE_AFTER_STEPS
from horizon_ray.engine.generate import Generator, Request, SamplingParams
from horizon_ray.errors import BadInput
from tests.tiny import FAMILY_BUILDERS, V, peft_reference, save, tiny_llama, tiny_qwen2


def tiny_mistral(tmp_path, name="model"):
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=V, sliding_window=6, tie_word_embeddings=False,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return save(MistralForCausalLM(cfg), tmp_path, name)


BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "mistral": tiny_mistral, **FAMILY_BUILDERS}
PROMPTS = [[5, 17, 33, 8, 91, 40, 12], [3, 9], [60, 61, 62, 63, 64, 70, 71, 72, 80, 81]]


def _hf_greedy(model, prompt, max_new, eos=None):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _reference(cls, path):
    kw = {"experts_implementation": "eager"} if "Moe" in cls.__name__ or "Mixtral" in cls.__name__ else {}
    return cls.from_pretrained(path, **kw).float().eval()


@pytest.mark.parametrize("graphs", [None, True], ids=["eager", "static-step"])
@pytest.mark.parametrize("family", list(BUILDERS))
def test_greedy_equals_hf_generate_on_every_family(tmp_path, family, graphs):
    """``static-step``: the decode steps run as decode_graphs.py's DecodeStep (the CUDA graph's body, reading
    static buffers, KV written by index), here without a graph: its arithmetic is the eager step's."""
    path, cls = BUILDERS[family](tmp_path)
    ref = _reference(cls, path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()  # run to max_tokens on both sides: tokens past a random eos are compared too
    gen.decode_graphs = graphs
    params = SamplingParams(max_tokens=12)
    got = gen.generate([Request(tuple(p), params) for p in PROMPTS])
    for p, c in zip(PROMPTS, got):
        assert c.token_ids == _hf_greedy(ref, p, 12), (family, p)
        assert c.finish_reason == "length" and c.prompt_tokens == len(p)
    # the prompts' pass is eager, and the first CAPTURE_AFTER_STEPS decode steps of a layout; the other 7 of the
    # 11 went through the static step (not on a mixture of experts: its steps stay eager, as on CUDA)
    static = graphs and not gen.model.num_experts
    assert (gen._graphs.replays if gen._graphs is not None else 0) == (11 - CAPTURE_AFTER_STEPS if static else 0)
    if gen._graphs is not None:  # the session ended: its steps and their hold on its cache went with it
        assert gen._graphs.cache is None and not gen._graphs.steps


def test_a_generator_with_decode_steps_is_freed_when_dropped(tmp_path):
    """The pool unloads a model by dropping its generator: its decode steps must not keep it (and its GPU
    weights, cache and graphs) alive in a reference cycle until a garbage collection."""
    import gc
    import weakref

    path, _ = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.decode_graphs = True
    gen.eos_ids = frozenset()
    gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=CAPTURE_AFTER_STEPS + 4))])
    assert gen._graphs is not None and gen._graphs.replays == 3
    gc.disable()
    try:
        ref = weakref.ref(gen)
        del gen
        assert ref() is None
    finally:
        gc.enable()


def test_eos_ends_a_row_as_hf_does(tmp_path):
    """The model's eos (generation_config.json) ends a row, included in its tokens; the others go on."""
    path, cls = tiny_llama(tmp_path)
    ref = _reference(cls, path)
    free = _hf_greedy(ref, PROMPTS[0], 8)
    eos = free[3]  # a token the model emits at its 4th step: make it the eos
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset({eos})
    got = gen.generate([Request(tuple(p), SamplingParams(max_tokens=8)) for p in PROMPTS])
    assert got[0].token_ids == _hf_greedy(ref, PROMPTS[0], 8, eos=eos) == free[:free.index(eos) + 1]
    assert got[0].finish_reason == "stop"
    for p, c in zip(PROMPTS[1:], got[1:]):
        assert c.token_ids == _hf_greedy(ref, p, 8, eos=eos)


def test_sampling_is_reproducible_with_a_seed_and_independent_of_the_batch(tmp_path):
    path, _ = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    hot = SamplingParams(max_tokens=10, temperature=1.5, seed=7)
    alone = gen.generate([Request(tuple(PROMPTS[0]), hot)])[0].token_ids
    batched = gen.generate([Request(tuple(PROMPTS[1]), SamplingParams(max_tokens=4, temperature=1.0, seed=1)),
                            Request(tuple(PROMPTS[0]), hot)])[1].token_ids
    assert alone == batched
    other = gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=10, temperature=1.5, seed=8))])
    assert other[0].token_ids != alone
    greedy = gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=10))])[0].token_ids
    assert alone != greedy  # at 1.5 the random model's choices are not the argmax


def test_top_k_1_and_a_tiny_top_p_are_greedy(tmp_path):
    path, _ = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    greedy = gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=10))])[0].token_ids
    for p in (SamplingParams(max_tokens=10, temperature=2.0, top_k=1, seed=3),
              SamplingParams(max_tokens=10, temperature=2.0, top_p=1e-6, seed=3)):
        assert gen.generate([Request(tuple(PROMPTS[0]), p)])[0].token_ids == greedy


def test_top_k_keeps_sampling_among_the_k_most_likely(tmp_path):
    path, cls = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    ref = _reference(cls, path)
    first = [gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=1, temperature=2.0, top_k=3,
                                                                     seed=s))])[0].token_ids[0] for s in range(40)]
    top3 = ref(torch.tensor([PROMPTS[0]])).logits[0, -1].topk(3).indices.tolist()
    assert set(first) <= set(top3) and len(set(first)) > 1


def test_lora_adapter_matches_peft_generate(tmp_path):
    from horizon_ray.engine import LoraConfig

    path, cls = tiny_llama(tmp_path)
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    peft_model, _ = peft_reference(cls.from_pretrained(path).float(), lora, tmp_path)
    peft_model.save_pretrained(tmp_path / "adapter")  # base_model_name_or_path: the tiny model's directory
    peft_model.eval()
    gen = Generator.from_pretrained(tmp_path / "adapter", device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    got = gen.generate([Request(tuple(p), SamplingParams(max_tokens=10)) for p in PROMPTS])
    gen.decode_graphs = True  # the static decode step applies the adapters as the eager one does
    assert [c.token_ids for c in gen.generate([Request(tuple(p), SamplingParams(max_tokens=10))
                                               for p in PROMPTS])] == [c.token_ids for c in got]
    assert gen._graphs is not None and gen._graphs.replays == 9 - CAPTURE_AFTER_STEPS
    base = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    base.eos_ids = frozenset()
    plain = base.generate([Request(tuple(p), SamplingParams(max_tokens=10)) for p in PROMPTS])
    for p, c in zip(PROMPTS, got):
        assert c.token_ids == _hf_greedy(peft_model, p, 10)
    assert [c.token_ids for c in got] != [b.token_ids for b in plain]  # the adapter changes the output


class _CharTokenizer:
    """One character per token id (ids 3.., 0-2 special): enough for stop sequences and text deltas."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + (i - 3) % 26) for i in ids if i > 2)


def test_stop_sequences_and_max_tokens(tmp_path):
    path, _ = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    free = gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=12))])[0]
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    gen.tokenizer = _CharTokenizer()
    text = gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=12))])[0].text
    assert len(text) == 12
    stop = text[5:7]
    first = text.find(stop)
    c = gen.generate([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=12, stop=(stop, "\n\n")))])[0]
    assert c.text == text[:first] and c.finish_reason == "stop"
    assert c.token_ids == free.token_ids[:first + 2]  # ended on the token that completed the stop sequence
    # streamed: the pieces add up to the final text, and none of the stop sequence was ever sent
    pieces = [d.text for step in gen.stream([Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=12, stop=(stop,)))])
              for d in step]
    assert "".join(pieces) == text[:first]


def test_bad_requests_are_refused_with_the_fix(tmp_path):
    path, _ = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    for params, word in ((SamplingParams(max_tokens=0), "max_tokens"), (SamplingParams(temperature=3.0), "temperature"),
                         (SamplingParams(top_p=0.0), "top_p"), (SamplingParams(stop=("",)), "stop")):
        with pytest.raises(BadInput, match=word):
            gen.generate([Request((5, 6), params)])
    with pytest.raises(BadInput, match="vocab_size"):
        gen.generate([Request((5, V + 3))])
    with pytest.raises(BadInput, match="empty"):
        gen.generate([Request(())])
    with pytest.raises(BadInput, match="context"):
        gen.generate([Request((5, 6), SamplingParams(max_tokens=10**6))])
    with pytest.raises(BadInput, match="tokenizer"):
        gen.chat_prompt([{"role": "user", "content": "hi"}])


def test_a_kv_cache_kept_in_host_memory_gives_the_same_tokens(tmp_path):
    """Layers whose cache does not fit the device keep it on the host ([S, B, kvH, d]) and stage it per layer."""
    path, _ = tiny_llama(tmp_path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    want = [c.token_ids for c in gen.generate([Request(tuple(p), SamplingParams(max_tokens=8)) for p in PROMPTS])]
    for on_device in (0, 2):
        gen.kv_layers_on_device = on_device
        got = [c.token_ids for c in gen.generate([Request(tuple(p), SamplingParams(max_tokens=8)) for p in PROMPTS])]
        assert got == want, on_device


def test_a_model_from_its_tensors_generates_as_hf(tmp_path):
    """from_tensors (the benchmark's random-init models: no checkpoint on disk) is the same model."""
    path, cls = tiny_qwen2(tmp_path)
    ref = _reference(cls, path)
    gen = Generator.from_tensors(ref.config.to_dict(), dict(ref.state_dict()), device="cpu")
    got = gen.generate([Request(tuple(p), SamplingParams(max_tokens=8)) for p in PROMPTS])
    assert [c.token_ids for c in got] == [_hf_greedy(ref, p, 8) for p in PROMPTS]


def test_attention_shapes_change_once_per_bucket_and_tokens_stay_hf_s(tmp_path, monkeypatch):
    """Attention reads the cache up to a multiple of KV_BUCKET positions, so its shapes (a cuDNN plan each)
    change once per bucket, not every decode step; the masked positions past the written ones change no token,
    with the cache on the device or staged from the host."""
    from horizon_ray.engine import generate as generate_mod

    monkeypatch.setattr(generate_mod, "KV_BUCKET", 4)
    path, cls = tiny_llama(tmp_path)
    ref = _reference(cls, path)
    want = [_hf_greedy(ref, p, 12) for p in PROMPTS]
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    lengths: list[int] = []
    kernels = type(gen.template.ops)
    attention = kernels.attention

    def spy(self, q, k, v, mask, scale):
        lengths.append(k.shape[2])
        assert mask.shape[-1] == k.shape[2]
        return attention(self, q, k, v, mask, scale)

    monkeypatch.setattr(kernels, "attention", spy)
    T0, new = max(map(len, PROMPTS)), 12
    for on_device in (None, 0, 1):
        if on_device is not None:
            gen.kv_layers_on_device = on_device
        lengths.clear()
        got = [c.token_ids for c in gen.generate([Request(tuple(p), SamplingParams(max_tokens=new)) for p in PROMPTS])]
        assert got == want, on_device
        # the prompts' pass, then 11 decode steps over positions 10 .. 21 of a 22-position cache
        assert sorted(set(lengths)) == [12, 16, 20, 22], on_device
        assert len(lengths) == new * gen.model.num_layers
    assert T0 == 10


@pytest.mark.parametrize("on_device,graphs", [(None, None), (None, True), (0, None), (1, None), (1, True)],
                         ids=["device-kv", "device-kv-static-step", "host-kv", "split-kv", "split-kv-static-step"])
def test_rows_that_join_and_leave_a_running_batch_make_the_tokens_they_make_alone(tmp_path, monkeypatch, on_device,
                                                                                 graphs):
    """Continuous batching (Session): requests join between decode steps (a prompt shorter than the cached
    slots, and one longer, which shifts the batch), rows finish at different steps and leave (the cache laid
    out again), one is cancelled; every row's tokens equal HF generate's of its prompt alone."""
    from horizon_ray.engine import generate as generate_mod

    monkeypatch.setattr(generate_mod, "KV_BUCKET", 4)  # bucket edges crossed too
    # the static step from a layout's first decode step: this batch is laid out anew every few steps
    monkeypatch.setattr(decode_graphs, "CAPTURE_AFTER_STEPS", 0)
    path, cls = tiny_llama(tmp_path)
    ref = _reference(cls, path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    if on_device is not None:
        gen.kv_layers_on_device = on_device
    gen.decode_graphs = graphs
    prompts = {"a": PROMPTS[0], "b": PROMPTS[1], "c": PROMPTS[2], "d": list(range(20, 45)), "e": [7, 7, 8]}
    max_tokens = {"a": 14, "b": 3, "c": 9, "d": 6, "e": 10}
    got: dict = {k: [] for k in prompts}
    session = gen.session()

    def admit(*keys):
        for key, d in session.admit([Request(tuple(prompts[k]), SamplingParams(max_tokens=max_tokens[k]))
                                     for k in keys], keys):
            got[key].append(d.token_id)

    def step(times=1):
        for _ in range(times):
            for key, d in session.step():
                got[key].append(d.token_id)

    admit("a")
    step(3)
    admit("b", "c")  # prompts of 2 and 10 tokens into 10 cached slots
    step(4)  # b finishes: a quarter of the batch, it leaves
    assert len(session) == 2
    admit("d")  # 25 prompt tokens: longer than the 14 cached slots, the batch shifts right
    step(2)
    admit("e")
    step(1)
    session.cancel(["c"])
    cancelled_at = len(got["c"])
    while len(session):
        step()
    for key, prompt in prompts.items():
        want = _hf_greedy(ref, prompt, max_tokens[key])
        if key == "c":
            assert got[key] == want[:cancelled_at] and cancelled_at < max_tokens[key]
        else:
            assert got[key] == want, key
    # the static step serves a cache whose every layer is on the device (split-kv: the eager step, always)
    replays = gen._graphs.replays if gen._graphs is not None else 0
    assert (replays > 0) == (graphs is True and on_device is None)


def test_a_session_under_steady_traffic_keeps_only_the_slots_its_rows_use(tmp_path):
    """A service's session may never empty: request after request joins while others finish. The slots before
    the oldest row that stays are dropped whenever the batch is laid out again, so the cache stays the size of
    what its rows hold and need, however long the session runs; every row still gets HF's tokens."""
    path, cls = tiny_llama(tmp_path)
    ref = _reference(cls, path)
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    session = gen.session()
    prompts = [PROMPTS[i % 3] for i in range(8)]
    got: dict = {i: [] for i in range(8)}
    capacities = []
    for i, prompt in enumerate(prompts):  # a request joins every 4 steps; each runs 6 tokens
        for key, d in session.admit([Request(tuple(prompt), SamplingParams(max_tokens=6))], [i]):
            got[key].append(d.token_id)
        for _ in range(4):
            for key, d in session.step():
                got[key].append(d.token_id)
        capacities.append(session.cache.capacity)
    while len(session):
        for key, d in session.step():
            got[key].append(d.token_id)
    # 8 requests over 32 steps: without trimming the slots would grow past 32 + 10
    assert max(capacities) <= 10 + 2 * 6 + 1, capacities
    for i, prompt in enumerate(prompts):
        assert got[i] == _hf_greedy(ref, prompt, 6), i


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_an_adapter_on_a_pre_quantized_base_generates_as_peft_over_bitsandbytes(tmp_path, quantize):
    """A QLoRA adapter whose base is a pre-quantized checkpoint (transformers + bitsandbytes): the generator
    dequantizes the base as bitsandbytes does and applies the adapter; greedy tokens equal PEFT's over the
    bitsandbytes model (its forward, step by step: bitsandbytes 0.50's CPU inference path refuses these tiny
    shapes in generate)."""
    from horizon_ray.engine import LoraConfig
    from tests.unit.test_engine_qlora_prequant import _loaded, _saved_quantized

    qdir, cls = _saved_quantized(tmp_path, quantize, quantize != "int8")
    # a B large enough that the adapter moves the greedy tokens of these tiny models
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj"))
    peft, adapter = peft_reference(_loaded(cls, qdir), lora, tmp_path, b_scale=0.5)
    gen = Generator.from_pretrained(adapter, device="cpu", tokenizer=None)
    gen.eos_ids = frozenset()
    got = gen.generate([Request(tuple(p), SamplingParams(max_tokens=10)) for p in PROMPTS])
    # peft_reference leaves the model in training mode; no dropout anywhere: its forward is the model's function
    assert [c.token_ids for c in got] == [_greedy_forward(peft, p, 10) for p in PROMPTS]
    with peft.disable_adapter():  # the adapter was applied: the base alone says otherwise for every prompt
        assert all(c.token_ids != _greedy_forward(peft, p, 10) for c, p in zip(got, PROMPTS))


def _greedy_forward(model, prompt, n):
    """`n` greedy tokens after `prompt` from `model`'s forward, one step at a time."""
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(input_ids=seq).logits[0, -1].argmax().view(1, 1)], 1)
    return seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_an_adapter_trained_on_a_quantized_base_generates_over_that_base(tmp_path, quantize):
    """A job with lora.quantize quantizes a float base while loading; its adapter records that
    (quantized_base.json), and generation runs the adapter over the base quantized the same way, as PEFT over
    transformers + bitsandbytes does (greedy, step by step as above); quantize="none" runs it over the float base."""
    from peft import PeftModel
    from transformers import BitsAndBytesConfig

    from horizon_ray.engine import Engine, EngineConfig, LoraConfig
    from tests.tiny import random_batches

    path, cls = tiny_llama(tmp_path)
    lora = LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), quantize=quantize)
    eng = Engine.from_pretrained(path, EngineConfig(lr=1e-2, device="cpu", compute_dtype="float32", lora=lora))
    for mbs in random_batches(2, 1, B=2, T=16, prompt=2, vocab=V):
        eng.train_step(mbs)
    eng.save_pretrained(tmp_path / "adapter")
    eng.close()
    gen = Generator.from_pretrained(tmp_path / "adapter", device="cpu", tokenizer=None)
    assert gen.store.quantize == quantize
    gen.eos_ids = frozenset()
    got = gen.generate([Request(tuple(p), SamplingParams(max_tokens=8)) for p in PROMPTS])
    bnb = BitsAndBytesConfig(load_in_8bit=True) if quantize == "int8" else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quantize, bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)
    base = cls.from_pretrained(path, quantization_config=bnb, device_map="cpu", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter")
    peft.train()  # no dropout anywhere: the training-mode forward is the model's function
    for prompt, c in zip(PROMPTS, got):
        seq = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(8):
                seq = torch.cat([seq, peft(input_ids=seq).logits[0, -1].argmax().view(1, 1)], 1)
        assert c.token_ids == seq[0, len(prompt):].tolist(), prompt
    assert Generator.from_pretrained(tmp_path / "adapter", device="cpu", tokenizer=None,
                                     quantize="none").store.quantize == "none"
    (tmp_path / "adapter" / "quantized_base.json").write_text("{not json")
    with pytest.raises(BadInput, match="quantized_base.json"):
        Generator.from_pretrained(tmp_path / "adapter", device="cpu", tokenizer=None)


def test_a_decode_steps_grouped_query_attention_repeats_no_keys(monkeypatch):
    """One query a row with grouped heads (a decode step): the query heads of each key/value head are folded
    into its queries, so SDPA runs without grouped-query support (its math path repeats every cached key and
    value per query head) and gives what the grouped-query call gives."""
    import torch.nn.functional as F

    from horizon_ray.engine import kernels as kernels_mod

    ops = kernels_mod.Kernels("torch")
    g = torch.Generator().manual_seed(0)
    B, H, kvH, S, d = 3, 8, 2, 37, 16
    q = torch.randn(B, H, 1, d, generator=g)
    k, v = torch.randn(B, kvH, S, d, generator=g), torch.randn(B, kvH, S, d, generator=g)
    mask = torch.rand(B, 1, 1, S, generator=g) < 0.7
    mask[..., -1] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q_, k_, v_, **kw):
        calls.append((tuple(q_.shape), kw.get("enable_gqa")))
        return sdpa(q_, k_, v_, **kw)

    monkeypatch.setattr(kernels_mod.F, "scaled_dot_product_attention", spy)
    got = ops.attention(q, k, v, mask, 0.25)
    assert calls == [((B, kvH, H // kvH, d), False)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_passes_tables_and_masks_are_built_on_the_device_that_reads_them(tmp_path, monkeypatch):
    """The eager pass (a prompt's, a joining row's) builds its RoPE tables and [B, 1, T, S] masks where the
    layers read them, as training and the static decode step do: built on the host they crossed as pageable
    copies while the GPU waited. The meta device stands for the GPU."""
    from types import SimpleNamespace

    path, _ = FAMILY_BUILDERS["gemma2"](tmp_path)  # sliding and global layers: two tables, two masks
    gen = Generator.from_pretrained(path, device="cpu", tokenizer=None)
    built_on: list[str] = []
    rope = decode_graphs.rope_tables

    def recording(inv_freq, pos, dtype):
        built_on.append(f"{pos.device.type}/{inv_freq.device.type}")
        return rope(inv_freq, pos, dtype)

    monkeypatch.setattr(decode_graphs, "rope_tables", recording)
    gen.device = torch.device("meta")
    B, S = 2, 8
    pos_BS, valid_BS = torch.arange(S).expand(B, S), torch.ones(B, S, dtype=torch.bool)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mb = gen._micro_batch(ids, pos_BS, valid_BS, SimpleNamespace(length=2, visible=lambda T: S))
    assert built_on == ["meta/meta"] * 2
    assert mb.cos_BTd.is_meta and mb.mask_B1TT.is_meta and mb.mask_B1TT.shape == (B, 1, 3, S)
    assert mb.sliding is not None and mb.sliding[2].is_meta
