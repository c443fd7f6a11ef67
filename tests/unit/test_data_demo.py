"""The demo tokenizer (offline, deterministic, round-trips, chat template) and the checkable demo tasks."""

import hashlib

import pytest
from transformers import AutoTokenizer

from horizon_ray.data import (
    DEMO_TASKS,
    build_datasets,
    build_demo_tokenizer,
    evaluate_demo,
    load_examples,
    make_demo_dataset,
    make_demo_items,
    read_demo_items,
    score_answer,
)
from horizon_ray.data.tokenizer import DEMO_VOCAB_SIZE


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        str(build_demo_tokenizer(tmp_path_factory.mktemp("tok"))), local_files_only=True
    )


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tokenizer_files_are_deterministic(tmp_path):
    a, b = build_demo_tokenizer(tmp_path / "a"), build_demo_tokenizer(tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert set(_digest(a)) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def test_tokenizer_round_trips_and_knows_its_special_tokens(tok):
    assert len(tok) == DEMO_VOCAB_SIZE == 262
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for text in [
        "add 17 and 25",
        "  leading and trailing  ",
        "naïve café ✓ 数字\n\ttab",
        "<|eos|> is special",
    ]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert len(tok("abc", add_special_tokens=False)["input_ids"]) == 3  # one token per byte
    assert tok("abc")["input_ids"][0] == tok.bos_token_id
    assert tok.decode(tok("naïve")["input_ids"], skip_special_tokens=True) == "naïve"


def test_chat_template_renders(tok):
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    assert (
        tok.apply_chat_template(msgs, tokenize=False)
        == "<|bos|><|system|>s<|eos|><|user|>u<|eos|><|assistant|>a<|eos|>"
    )
    prompt = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|user|>u<|eos|><|assistant|>"
    ids = tok.apply_chat_template(msgs[1:2], tokenize=True, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert ids == [
        1,
        tok.convert_tokens_to_ids("<|user|>"),
        *tok.encode("u", add_special_tokens=False),
        2,
        tok.convert_tokens_to_ids("<|assistant|>"),
    ]


def _check(item):
    word = item.prompt.split(" ", 1)[1]
    if item.task == "add":
        _, a, _, b = item.prompt.split()
        return item.answer == str(int(a) + int(b))
    return item.answer == {"copy": word, "reverse": word[::-1], "sort": "".join(sorted(word))}[item.task]


def test_demo_items_are_correct_short_and_seeded():
    items = make_demo_items(400, seed=0)
    assert all(_check(it) for it in items)
    assert [it.task for it in items[:8]] == list(DEMO_TASKS) * 2
    assert max(len(it.prompt) for it in items) <= 12 and max(len(it.answer) for it in items) <= 4
    assert make_demo_items(400, seed=0) == items and make_demo_items(400, seed=1) != items
    held_out = make_demo_items(
        50, seed=9, tasks=("copy", "reverse", "sort"), exclude={it.prompt for it in items}
    )
    assert not {it.prompt for it in held_out} & {it.prompt for it in items}
    with pytest.raises(ValueError, match="'add' has no prompt left"):
        make_demo_items(
            10, seed=2, tasks=("add",), exclude={f"add {a} and {b}" for a in range(10) for b in range(10)}
        )
    with pytest.raises(ValueError, match="unknown demo task 'mul'"):
        make_demo_items(3, seed=0, tasks=("mul",))


@pytest.mark.parametrize("fmt", ["messages", "alpaca"])
def test_demo_dataset_loads_and_fits_a_small_seq_len(tmp_path, tok, fmt):
    f = make_demo_dataset(tmp_path / "demo.jsonl", 40, seed=3, fmt=fmt)
    ex = load_examples(f)
    items = read_demo_items(f)
    assert items == make_demo_items(40, seed=3)
    assert [e.messages[-1]["content"] for e in ex] == [it.answer for it in items]
    train, _ = build_datasets(f, "auto", tok, 24, seed=0)
    assert len(train) == 40 and train.num_truncated == 0
    assert max(len(e) for e in train.examples) <= 21


def test_scoring_is_exact_match_per_task():
    items = make_demo_items(8, seed=0)
    preds = [it.answer for it in items]
    preds[0] = preds[0] + "0"  # add: wrong
    preds[1] = f" {preds[1]}\n"  # copy: right, whitespace ignored
    score = evaluate_demo(items, preds)
    assert score.accuracy == 7 / 8 and score.n == 8
    assert score.per_task == {"add": 0.5, "copy": 1.0, "reverse": 1.0, "sort": 1.0}
    assert score_answer("42", "42") and not score_answer("4 2", "42")
    with pytest.raises(ValueError, match="8 items but 7 predictions"):
        evaluate_demo(items, preds[:7])
