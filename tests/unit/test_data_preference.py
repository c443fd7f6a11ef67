"""Preference data: TRL's and OpenAI's layouts, the refusals (file:line), pair tokenization and truncation,
the pair sampler, and the upload checks and statistics."""

import json

import pytest

from horizon_ray.data import build_demo_tokenizer, load_tokenizer
from horizon_ray.data.formats import LineChecker, detect_format, load_examples
from horizon_ray.data.pairs import PairSampler, tokenize_pairs
from horizon_ray.data.preference import load_pairs
from horizon_ray.data.stats import dataset_stats
from horizon_ray.data.tokenize import IGNORE_INDEX
from horizon_ray.errors import BadInput


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_demo_tokenizer(tmp_path_factory.mktemp("tok")))


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TRL_CHAT = {"prompt": [{"role": "user", "content": "copy abc"}], "chosen": [{"role": "assistant", "content": "abc"}],
            "rejected": [{"role": "assistant", "content": "ABC"}]}
OPENAI = {"input": {"messages": [{"role": "user", "content": "copy abc"}], "tools": []},
          "preferred_output": [{"role": "assistant", "content": "abc"}],
          "non_preferred_output": [{"role": "assistant", "content": "ABC"}]}
TRL_TEXT = {"prompt": "copy abc:", "chosen": " abc", "rejected": " ABC"}


def test_trl_and_openai_layouts_give_the_same_rows(tmp_path, tok):
    trl = tokenize_pairs(load_pairs(_write(tmp_path / "a.jsonl", [TRL_CHAT])), tok, 64)
    oai = tokenize_pairs(load_pairs(_write(tmp_path / "b.jsonl", [OPENAI])), tok, 64)
    assert detect_format(tmp_path / "a.jsonl") == detect_format(tmp_path / "b.jsonl") == "preference"
    for a, b in zip(trl.examples, oai.examples):
        assert list(a.input_ids) == list(b.input_ids) and list(a.labels) == list(b.labels)
    chosen, rejected = trl.examples
    prompt = tok.apply_chat_template(TRL_CHAT["prompt"], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    # the two rows share the prompt; only the completion (with its end-of-turn token) is labelled
    assert list(chosen.input_ids[:n_prompt]) == list(rejected.input_ids[:n_prompt])
    assert all(t == IGNORE_INDEX for t in chosen.labels[:n_prompt])
    assert tok.decode([t for t in chosen.labels if t != IGNORE_INDEX]) == "abc<|eos|>"
    assert tok.decode([t for t in rejected.labels if t != IGNORE_INDEX]) == "ABC<|eos|>"


def test_plain_text_pairs_append_eos(tmp_path, tok):
    ds = tokenize_pairs(load_pairs(_write(tmp_path / "t.jsonl", [TRL_TEXT])), tok, 64)
    assert tok.decode([t for t in ds.examples[0].labels if t != IGNORE_INDEX]) == " abc<|eos|>"
    assert tok.decode(list(ds.examples[1].input_ids)).startswith("<|bos|>copy abc: ABC")


@pytest.mark.parametrize("record, message", [
    # half a pair is a pair missing its partner (before: "cannot tell the format", as if it were SFT data)
    ({"prompt": "p", "chosen": "c"}, "'chosen' without 'rejected'.*add 'rejected'"),
    ({"prompt": [{"role": "user", "content": "x"}], "rejected": [{"role": "assistant", "content": "r"}]},
     "'rejected' without 'chosen'.*add 'chosen'"),
    ({k: v for k, v in OPENAI.items() if k != "preferred_output"},
     "'non_preferred_output' without 'preferred_output'.*add 'preferred_output'"),
    ({"prompt": "p", "chosen": "c", "rejected": 3}, "'rejected' must be a string"),
    ({"prompt": "p", "chosen": " ", "rejected": "r"}, "'chosen' is empty"),
    ({"chosen": "c", "rejected": "r"}, "no 'prompt'"),
    ({**TRL_CHAT, "chosen": [{"role": "user", "content": "x"}]}, "assistant's turns only"),
    ({**TRL_CHAT, "rejected": "ABC"}, "'rejected' must be a list of assistant messages"),
    ({**OPENAI, "input": {"msgs": []}}, "'input' must be an object with 'messages'"),
    ({k: v for k, v in OPENAI.items() if k != "non_preferred_output"},
     "'preferred_output' without 'non_preferred_output'"),
])
def test_malformed_pairs_are_refused_with_their_line(tmp_path, record, message):
    path = _write(tmp_path / "bad.jsonl", [TRL_CHAT, record])
    with pytest.raises(BadInput, match=message) as err:
        load_pairs(path)
    assert f"{path}:2" in str(err.value)
    checker = LineChecker("auto", "upload.jsonl", 1 << 20)  # an upload is refused at the same line
    with pytest.raises(BadInput, match=f"upload.jsonl:2: .*{message}"):
        checker.feed(path.read_bytes())
        checker.finish()
    alone = _write(tmp_path / "alone.jsonl", [record])  # as the first line too, where the format is detected
    with pytest.raises(BadInput, match=f"alone.jsonl:1: .*{message}"):
        load_pairs(alone)


def test_objectives_refuse_each_others_data(tmp_path):
    pairs = _write(tmp_path / "pairs.jsonl", [TRL_CHAT])
    sft = _write(tmp_path / "sft.jsonl", [{"messages": TRL_CHAT["prompt"] + TRL_CHAT["chosen"]}])
    with pytest.raises(BadInput, match="set objective: dpo"):
        load_examples(pairs)
    with pytest.raises(BadInput, match=r"sft.jsonl:1: not a preference pair \(messages data\)"):
        load_pairs(sft)
    checker = LineChecker("auto", "pairs.jsonl", 1 << 20)
    checker.feed(pairs.read_bytes())
    assert checker.finish() == ("preference", 1)


def test_truncation_keeps_the_prompts_end_and_the_completions_start(tmp_path, tok):
    long_prompt = "x" * 40 + "END"
    record = {"prompt": long_prompt, "chosen": "abcdefghij" * 3, "rejected": "short"}
    path = _write(tmp_path / "long.jsonl", [record, TRL_TEXT])
    ds = tokenize_pairs(load_pairs(path), tok, 32)
    assert ds.num_truncated == 1
    chosen, rejected = ds.examples[:2]
    assert max(len(chosen), len(rejected)) <= 32
    text = tok.decode(list(chosen.input_ids))
    assert "END" in text and text.index("END") < text.index("abc")  # the prompt's end kept, before the completion
    completion = tok.decode([t for t in chosen.labels if t != IGNORE_INDEX])
    assert completion == "abcdefghij"[:len(completion)] or ("abcdefghij" * 3).startswith(completion)
    assert len(completion) == 32 - 16  # the prompt keeps seq_len // 2, the completion the rest
    assert tok.decode(list(rejected.input_ids[:16])) == tok.decode(list(chosen.input_ids[:16]))
    stats = dataset_stats(path, "auto", tok)
    assert stats.format == "preference" and stats.examples == 2
    assert stats.truncated_pairs[512] == 0 and stats.max_tokens == len(tok(long_prompt)["input_ids"]) + 31


def test_pair_sampler_keeps_pairs_adjacent_and_is_a_function_of_the_step(tmp_path, tok):
    records = [{"prompt": f"copy {w}", "chosen": f" {w}", "rejected": f" {w.upper()}"}
               for w in ("ab", "cde", "fghi", "jk", "lmn", "op", "qrs", "tuvw")]
    ds = tokenize_pairs(load_pairs(_write(tmp_path / "p.jsonl", records)), tok, 32)
    sampler = PairSampler(ds, micro_batch_size=4, grad_accum=2, seed=5)
    assert sampler.steps_per_epoch == 2
    rows = sampler.rows_for_step(0)
    assert sorted(rows + sampler.rows_for_step(1)) == list(range(16))  # an epoch visits every pair once
    assert all(rows[i] % 2 == 0 and rows[i + 1] == rows[i] + 1 for i in range(0, 8, 2))
    assert rows == PairSampler(ds, 4, 2, seed=5).rows_for_step(0) != sampler.rows_for_step(2)
    batches = sampler.batches_for_step(0)
    assert len(batches) == 2 and all(b[0].shape[0] == 4 for b in batches)
    for _ids, labels, _ in batches:
        for r in range(0, 4, 2):  # chosen and rejected of a pair: lowercase, then the same in capitals
            c = tok.decode([t for t in labels[r].tolist() if t != IGNORE_INDEX])
            assert tok.decode([t for t in labels[r + 1].tolist() if t != IGNORE_INDEX]) == c.upper().replace(
                "<|EOS|>", "<|eos|>")
    assert sampler.tokens_for_step(0) == sum(len(ds.examples[r]) for r in rows)
    with pytest.raises(BadInput, match="even number"):
        PairSampler(ds, micro_batch_size=3)


U = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy abc"}]


@pytest.mark.parametrize("record", [
    # TRL's implicit prompt: both conversations start with it
    {"chosen": U + TRL_CHAT["chosen"], "rejected": U + TRL_CHAT["rejected"]},
    # UltraFeedback's layout: 'prompt' is the last user turn the conversations repeat
    {"prompt": "copy abc", "chosen": U + TRL_CHAT["chosen"], "rejected": U + TRL_CHAT["rejected"]},
    {"prompt": U, "chosen": U + TRL_CHAT["chosen"], "rejected": U + TRL_CHAT["rejected"]},
])
def test_conversations_that_repeat_their_prompt_give_the_pair_of_the_prompt_apart(tmp_path, tok, record):
    # before: refused ("no 'prompt'", or "'chosen' must be a string like 'prompt'" for UltraFeedback's)
    apart = {"prompt": U, "chosen": TRL_CHAT["chosen"], "rejected": TRL_CHAT["rejected"]}
    got = tokenize_pairs(load_pairs(_write(tmp_path / "a.jsonl", [record])), tok, 64)
    want = tokenize_pairs(load_pairs(_write(tmp_path / "b.jsonl", [apart])), tok, 64)
    assert [(e.input_ids.tolist(), e.labels.tolist()) for e in got.examples] == \
        [(e.input_ids.tolist(), e.labels.tolist()) for e in want.examples]


@pytest.mark.parametrize(("record", "words"), [
    ({"chosen": [{"role": "user", "content": "copy abc"}, *TRL_CHAT["chosen"]],
      "rejected": [{"role": "user", "content": "copy xyz"}, *TRL_CHAT["rejected"]]},
     "'chosen' and 'rejected' hold different prompts (they part at message 0, a user turn)"),
    ({"prompt": "sort 312", "chosen": U + TRL_CHAT["chosen"], "rejected": U + TRL_CHAT["rejected"]},
     "'prompt' is not the last user turn of the conversations' common first turns"),
    ({"chosen": U + TRL_CHAT["chosen"], "rejected": U + TRL_CHAT["chosen"]},
     "'chosen' and 'rejected' are the same conversation"),
])
def test_pairs_whose_prompts_differ_are_refused_with_their_line(tmp_path, record, words):
    path = _write(tmp_path / "bad.jsonl", [TRL_CHAT, record])
    with pytest.raises(BadInput, match="bad.jsonl:2: ") as exc:
        load_pairs(path)
    assert words in str(exc.value)
