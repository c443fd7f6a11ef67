"""Data as users have it: ShareGPT with its roles, .json arrays, renamed columns, a chosen chat template, the
train-on-inputs switch and OpenAI's per-message weight; loss masks checked against masks computed by hand on the
byte-level demo tokenizer (one token per byte, special tokens as single ids), errors naming file:line."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from horizon_ray.data import IGNORE_INDEX, build_demo_tokenizer, load_examples, tokenize_example
from horizon_ray.data.formats import Layout, detect_format, layout_of
from horizon_ray.data.tokenize import CHAT_TEMPLATES, with_chat_template
from horizon_ray.jobspec import JobSpec

BYTE0 = 6  # the demo tokenizer's id of byte 0: special tokens take ids 0..5


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_demo_tokenizer(tmp_path_factory.mktemp("tok"))


def _tok(tok_dir, template=None):
    return with_chat_template(AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True), template)


def _bytes(text: str) -> list[int]:
    return [BYTE0 + b for b in text.encode()]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_sharegpt_maps_roles_and_the_system_column(tmp_path):
    f = _write(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "system": "be brief"},
        {"conversations": [{"from": "user", "value": "a"}, {"from": "assistant", "value": "b"}]},
    ])
    assert detect_format(f) == "sharegpt"
    first, second = load_examples(f)
    assert first.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "yo"}]
    assert second.messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    bad = _write(tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "a"},
                                                             {"from": "bot", "value": "b"}]}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: conversations\[1\] has from 'bot'.*data.roles"):
        load_examples(bad)
    (example,) = load_examples(bad, "sharegpt", Layout(roles={"bot": "assistant"}))
    assert example.messages[1] == {"role": "assistant", "content": "b"}


def test_a_json_array_loads_and_its_errors_name_the_line_a_record_starts_on(tmp_path):
    f = tmp_path / "data.json"
    f.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c",\n   "output": "d"}\n]\n')
    assert [e.messages[1]["content"] for e in load_examples(f)] == ["b", "d"]
    assert [e.source for e in load_examples(f)] == [f"{f}:2", f"{f}:3"]
    f.write_text('[\n  {"instruction": "a", "output": "b"},\n\n  {"instruction": "c"}\n]')
    with pytest.raises(ValueError, match=r"data.json:4: missing 'output'"):
        load_examples(f, "alpaca")
    f.write_text('[\n  {"instruction": "a", "output": "b"}\n  {"instruction": "c", "output": "d"}]')
    with pytest.raises(ValueError, match=r"data.json:3: expected ',' or '\]'"):
        load_examples(f)
    f.write_text('{"instruction": "a", "output": "b"}')
    with pytest.raises(ValueError, match=r"data.json:1: a .json dataset must be an array"):
        load_examples(f)
    (tmp_path / "more.jsonl").write_text(json.dumps({"instruction": "e", "output": "f"}) + "\n")
    f.write_text('[{"instruction": "a", "output": "b"}]')
    assert len(load_examples(tmp_path)) == 2  # a folder gives its .json and .jsonl files


def test_columns_rename_the_keys_of_each_format(tmp_path):
    chat = _write(tmp_path / "chat.jsonl", [{"dialog": [{"speaker": "user", "text": "q"},
                                                        {"speaker": "assistant", "text": "r"}]}])
    layout = Layout({"messages": "dialog", "role": "speaker", "content": "text"})
    assert detect_format(chat, layout) == "messages"
    assert load_examples(chat, "auto", layout)[0].messages[1] == {"role": "assistant", "content": "r"}
    alpaca = _write(tmp_path / "alpaca.jsonl", [{"prompt": "p", "query": "q", "response": "r", "sys": "s"}])
    layout = Layout({"instruction": "prompt", "input": "query", "output": "response", "system": "sys"})
    assert load_examples(alpaca, "alpaca", layout)[0].messages == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "p\n\nq"},
        {"role": "assistant", "content": "r"}]
    with pytest.raises(ValueError, match="data.columns has no column 'answer'"):
        Layout({"answer": "x"})
    data = {"path": "d", "format": "sharegpt", "columns": {"messages": "turns"}, "roles": {"bot": "assistant"}}
    spec = JobSpec.from_dict({"model": {"path": "m"}, "data": data,
                              "training": {"max_steps": 1}, "output_dir": "o"})
    assert layout_of(spec.data) == Layout({"messages": "turns"}, {"bot": "assistant"})
    with pytest.raises(ValueError, match="did you mean 'data.columns.messages'"):
        JobSpec.from_dict({"model": {"path": "m"}, "data": {"path": "d", "columns": {"mesages": "x"}},
                           "training": {"max_steps": 1}, "output_dir": "o"})


def test_weight_zero_leaves_an_assistant_turn_out_of_the_mask(tok_dir, tmp_path):
    f = _write(tmp_path / "w.jsonl", [{"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "bad", "weight": 0},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "ok", "weight": 1}]}])
    (example,) = load_examples(f)
    assert example.untrained == (1,)
    for template in (None, "chatml"):  # the demo template's {% generation %} route, and the prefix route
        tok = _tok(tok_dir, template)
        te = tokenize_example(example, tok)
        trained = [t for t in te.labels if t != IGNORE_INDEX]
        eot = [tok.eos_token_id] if template is None else _bytes("<|im_end|>")
        assert trained == _bytes("ok") + eot, template
    for bad, why in (({"role": "user", "content": "a", "weight": 1}, "on assistant turns only"),
                     ({"role": "assistant", "content": "a", "weight": 0.5}, "is 0 .* or 1")):
        _write(f, [{"messages": [{"role": "user", "content": "q"}, bad]}])
        with pytest.raises(ValueError, match=f"w.jsonl:1: messages\\[1\\] has weight .*{why}"):
            load_examples(f)
    _write(f, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}])
    with pytest.raises(ValueError, match="w.jsonl:1: every assistant message has weight 0"):
        load_examples(f)


def test_a_named_template_renders_and_masks_as_computed_by_hand(tok_dir):
    from horizon_ray.data import Example

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    tok = _tok(tok_dir, "chatml")
    te = tokenize_example(Example(messages, None, "x:1"), tok)
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert list(te.input_ids) == _bytes(text)
    prompt = len("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    answer = len("yo<|im_end|>")
    expect = [IGNORE_INDEX] * prompt + _bytes("yo<|im_end|>") + [IGNORE_INDEX] * (len(text) - prompt - answer)
    assert list(te.labels) == expect
    llama = tokenize_example(Example(messages, None, "x:1"), _tok(tok_dir, "llama3"))
    head = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert list(llama.input_ids) == [tok.bos_token_id] + _bytes(head + "yo<|eot_id|>")
    assert [t for t in llama.labels if t != IGNORE_INDEX] == _bytes("yo<|eot_id|>")
    jinja = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
             "{% if add_generation_prompt %}[assistant]{% endif %}")
    custom = tokenize_example(Example(messages, None, "x:1"), _tok(tok_dir, jinja))
    assert list(custom.input_ids) == _bytes("[user]hi[assistant]yo")
    assert [t for t in custom.labels if t != IGNORE_INDEX] == _bytes("yo")
    with pytest.raises(ValueError, match="data.chat_template 'vicuna' is neither a known template"):
        _tok(tok_dir, "vicuna")
    assert set(CHAT_TEMPLATES) == {"chatml", "llama3"}


def test_train_on_inputs_trains_every_token_but_the_first_and_weight_zero_turns(tok_dir):
    from horizon_ray.data import Example

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "yes"}]
    tok = _tok(tok_dir, "chatml")
    everything = tokenize_example(Example(messages, None, "x:1"), tok, train_on_inputs=True)
    assert list(everything.labels) == [IGNORE_INDEX] + list(everything.input_ids)[1:]
    weighted = tokenize_example(Example(messages, None, "x:1", untrained=(1,)), tok, train_on_inputs=True)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    start = len("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    left_out = range(start, start + len("no<|im_end|>"))
    expect = [IGNORE_INDEX if i == 0 or i in left_out else t for i, t in enumerate(_bytes(text))]
    assert list(weighted.labels) == expect
    spec = JobSpec.from_dict({"model": {"path": "m"}, "data": {"path": "d", "train_on_inputs": True,
                                                             "chat_template": "{% for m in messages %}\n{% endfor %}"},
                              "training": {"max_steps": 1}, "output_dir": "o"})
    assert spec.data.train_on_inputs and spec.data.chat_template.startswith("{% for")


def test_a_sharegpt_upload_is_detected_and_checked_line_by_line(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.testing import make_testbed

    bed = make_testbed(tmp_path)
    line = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    with TestClient(create_app(bed.client, bed.settings)) as http:
        for fmt in ("auto", "sharegpt"):
            r = http.post(f"/files?filename=sg.jsonl&format={fmt}", content=(json.dumps(line) + "\n").encode() * 3,
                          headers={**bed.auth("acme"), "Content-Type": "application/x-ndjson"})
            assert r.status_code == 201, r.text
            assert (r.json()["format"], r.json()["num_examples"]) == ("sharegpt", 3)
        bad = json.dumps(line) + "\n" + json.dumps({"conversations": [{"from": "bot", "value": "x"}]}) + "\n"
        r = http.post("/files?filename=sg.jsonl", content=bad.encode(),
                      headers={**bed.auth("acme"), "Content-Type": "application/x-ndjson"})
        assert r.status_code == 422 and "sg.jsonl:2: conversations[0] has from 'bot'" in r.json()["error"]["message"]
    bed.close()


def test_the_readme_data_example_loads_strictly():
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "sharegpt" in b and "columns" in b)
    spec = JobSpec.from_dict({"model": {"path": "m"}, **yaml.safe_load(block), "training": {"max_steps": 1},
                              "output_dir": "o"})
    assert spec.data.format == "sharegpt" and layout_of(spec.data).roles == {"bot": "assistant"}
    assert spec.data.chat_template in CHAT_TEMPLATES
