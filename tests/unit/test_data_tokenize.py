"""Loss masks with the model's own tokenizer: exactly the assistant tokens (+ end of turn), by both routes."""

import pytest
from transformers import AutoTokenizer

from horizon_ray.data import (
    IGNORE_INDEX,
    Example,
    build_demo_tokenizer,
    tokenize_example,
    tokenize_examples,
)
from horizon_ray.data.tokenizer import DEMO_CHAT_TEMPLATE

# The demo template without {% generation %}: forces the prefix/offset route.
NO_GENERATION_TEMPLATE = DEMO_CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Qwen-like: a newline after every end-of-turn token, which must not become a target.
NEWLINE_TEMPLATE = NO_GENERATION_TEMPLATE.replace("{{ eos_token }}", "{{ eos_token + '\\n' }}")

MULTI_TURN = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "add 2 and 3"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "reverse cab"},
    {"role": "assistant", "content": "bac, of course ✓"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_demo_tokenizer(tmp_path_factory.mktemp("tok"))


def _tok(tok_dir, template=None):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    if template is not None:
        tok.chat_template = template
    return tok


def _segments(labels):
    """Contiguous runs of trained positions, as (start, end) pairs."""
    runs, start = [], None
    for i, t in enumerate([*labels, IGNORE_INDEX]):
        if t != IGNORE_INDEX and start is None:
            start = i
        elif t == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _expected_runs(tok, ids, messages):
    """Independent reference: each assistant content + eos sits right after an <|assistant|> marker."""
    marker = tok.convert_tokens_to_ids("<|assistant|>")
    starts = [i + 1 for i, t in enumerate(ids) if t == marker]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(starts) == len(answers)
    runs = []
    for s, a in zip(starts, answers):
        want = tok.encode(a, add_special_tokens=False) + [tok.eos_token_id]
        assert ids[s : s + len(want)] == want
        runs.append((s, s + len(want)))
    return runs


@pytest.mark.parametrize("template", [None, NO_GENERATION_TEMPLATE, NEWLINE_TEMPLATE])
def test_multi_turn_mask_is_every_assistant_turn_and_nothing_else(tok_dir, template):
    tok = _tok(tok_dir, template)
    te = tokenize_example(Example(MULTI_TURN, None, "x:1"), tok)
    assert tok.apply_chat_template(MULTI_TURN, tokenize=False).count("<|eos|>\n") == (
        5 if template == NEWLINE_TEMPLATE else 0
    )
    assert (
        list(te.input_ids)
        == tok.apply_chat_template(MULTI_TURN, tokenize=True, return_dict=True)["input_ids"]
    )
    runs = _segments(te.labels)
    assert runs == _expected_runs(tok, list(te.input_ids), MULTI_TURN)
    assert len(runs) == 2
    for s, e in runs:
        assert te.labels[s:e] == te.input_ids[s:e]
    decoded = [tok.decode(list(te.input_ids[s:e])) for s, e in runs]
    assert decoded == ["5<|eos|>", "bac, of course ✓<|eos|>"]


def test_both_routes_agree(tok_dir):
    with_tags = tokenize_example(Example(MULTI_TURN, None, "x:1"), _tok(tok_dir))
    by_prefix = tokenize_example(Example(MULTI_TURN, None, "x:1"), _tok(tok_dir, NO_GENERATION_TEMPLATE))
    assert with_tags == by_prefix


def test_alpaca_mask_is_exactly_the_output(tok_dir, tmp_path):
    from horizon_ray.data import load_examples

    f = tmp_path / "a.jsonl"
    f.write_text('{"instruction": "sort 3141", "input": "digits", "output": "1134"}\n')
    (ex,) = load_examples(f)
    tok = _tok(tok_dir)
    te = tokenize_example(ex, tok)
    trained = [t for t in te.labels if t != IGNORE_INDEX]
    assert trained == tok.encode("1134", add_special_tokens=False) + [tok.eos_token_id]
    assert (
        tok.decode(list(te.input_ids)) == "<|bos|><|user|>sort 3141\n\ndigits<|eos|><|assistant|>1134<|eos|>"
    )
    assert sum(t != IGNORE_INDEX for t in te.labels) == 5


def test_text_trains_every_token_but_the_first_and_ends_with_eos(tok_dir):
    tok = _tok(tok_dir)
    te = tokenize_example(Example(None, "hello world", "x:1"), tok)
    assert list(te.input_ids) == [
        tok.bos_token_id,
        *tok.encode("hello world", add_special_tokens=False),
        tok.eos_token_id,
    ]
    assert te.labels[0] == IGNORE_INDEX
    assert te.labels[1:] == te.input_ids[1:]


def test_truncation_is_counted_and_targetless_examples_dropped(tok_dir):
    tok = _tok(tok_dir)
    long_answer = Example(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 50}], None, "a:1"
    )
    long_prompt = Example(
        [{"role": "user", "content": "y" * 50}, {"role": "assistant", "content": "z"}], None, "a:2"
    )
    short = Example([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], None, "a:3")
    ds = tokenize_examples([long_answer, long_prompt, short], tok, seq_len=20)
    assert (ds.num_truncated, ds.num_dropped, len(ds)) == (2, 1, 2)
    assert [e.source for e in ds.examples] == ["a:1", "a:3"]
    assert len(ds.examples[0].input_ids) == 20 and len(ds.examples[1].input_ids) == 9
    # "<|bos|><|user|>hi<|eos|><|assistant|>" is 6 tokens; the remaining 14 are answer tokens.
    assert ds.num_label_tokens == 14 + 3
    assert ds.pad_id == tok.pad_token_id
    with pytest.raises(ValueError, match="none of the 1 examples has a target token within seq_len=20"):
        tokenize_examples([long_prompt], tok, seq_len=20)


def test_chat_data_without_chat_template_refused(tok_dir):
    tok = _tok(tok_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="d.jsonl:4: the tokenizer has no chat_template"):
        tokenize_example(Example(MULTI_TURN, None, "d.jsonl:4"), tok)


def test_template_that_is_not_prefix_stable_refused(tok_dir):
    # Renders a different system line depending on how many turns follow: the prefix route cannot work.
    tricky = NO_GENERATION_TEMPLATE.replace("{{- bos_token -}}", "{{- bos_token -}}{{ messages | length }}")
    with pytest.raises(ValueError, match="prefix-stable"):
        tokenize_example(Example(MULTI_TURN, None, "d.jsonl:1"), _tok(tok_dir, tricky))


def test_a_token_spanning_the_prompt_and_the_answer_is_trained(tmp_path):
    """A byte-level BPE merges the generation prompt's trailing space into the answer's first word
    (" Hello"): that token starts before the assistant span, and it is the first thing the answer trains."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["User: say hi\nAssistant: Hello there", "Assistant: Hello again", "User: ok"] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
                         "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}Assistant: {% endif %}")
    messages = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "Hello there"}]
    te = tokenize_example(Example(messages, None, "x:1"), tok)
    trained = [t for t in te.labels if t != IGNORE_INDEX]
    assert tok.convert_ids_to_tokens(trained)[0] == "ĠHello"  # the merged space-and-word token
    assert tok.decode(trained) == " Hello there</s>"
