"""JSONL formats: each loads into the same form, auto-detection, and malformed lines named by file:line."""

import json
from pathlib import Path

import pytest

from horizon_ray.data import detect_format, load_examples


def _write(path: Path, lines: list) -> Path:
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8"
    )
    return path


def test_alpaca_loads_with_and_without_input(tmp_path):
    f = _write(
        tmp_path / "a.jsonl",
        [
            {"instruction": "add 1 and 2", "output": "3"},
            "",
            {"instruction": "translate", "input": "chat", "output": "cat", "id": 7},
            {"instruction": "say hi", "input": "  ", "output": "hi"},
        ],
    )
    ex = load_examples(f, "alpaca")
    assert len(ex) == 3
    assert ex[0].messages == [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "3"},
    ]
    assert ex[1].messages[0]["content"] == "translate\n\nchat"
    assert ex[2].messages[0]["content"] == "say hi"  # blank input adds nothing
    assert ex[0].text is None
    assert ex[1].source == f"{f}:3"  # blank line 2 skipped, numbering stays the file's


def test_messages_and_text_load(tmp_path):
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    m = load_examples(_write(tmp_path / "m.jsonl", [{"messages": turns}]), "messages")
    assert m[0].messages == turns
    t = load_examples(_write(tmp_path / "t.jsonl", [{"text": "once upon"}, {"text": "a time"}]), "text")
    assert [e.text for e in t] == ["once upon", "a time"]
    assert t[0].messages is None


def test_auto_detects_each_file_of_a_folder(tmp_path):
    _write(tmp_path / "1.jsonl", [{"instruction": "i", "output": "o"}])
    _write(
        tmp_path / "2.jsonl",
        [{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}],
    )
    _write(tmp_path / "3.jsonl", ["", {"text": "plain"}])
    assert [detect_format(tmp_path / f"{i}.jsonl") for i in (1, 2, 3)] == ["alpaca", "messages", "text"]
    ex = load_examples(tmp_path, "auto")
    assert [e.text for e in ex] == [None, None, "plain"]
    assert ex[0].messages[1]["content"] == "o" and ex[1].messages[1]["content"] == "a"


@pytest.mark.parametrize(
    "line, fmt, problem",
    [
        ("{not json", "auto", "not valid JSON"),
        ("[1, 2]", "auto", "JSON object"),
        ({"instruction": "x"}, "alpaca", "missing 'output'"),
        ({"instruction": "x", "output": 3}, "alpaca", "'output' must be a string"),
        ({"instruction": " ", "output": "y"}, "alpaca", "'instruction' is empty"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "role 'bot'"),
        ({"messages": [{"role": "user", "content": None}]}, "messages", "content must be a string"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "messages", "no assistant message"),
        ({"text": ""}, "text", "'text' is empty"),
        ({"text": "ok", "id": 1, "meta": {"k": "v"}}, "text", None),
        ({"prompt": "x", "completion": "y"}, "auto", "cannot tell the format"),
        ({"text": "a text line in an alpaca file"}, "auto", "keep one format per file"),
        ('{"text": "a \\ud800 b"}', "text", "unpaired UTF-16 surrogate \\(\\\\ud800 at character 2\\)"),
        ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages", "messages\\[0\\] content holds"),
        ('{"text": ' + "[" * 3000 + "]" * 3000 + "}", "text", "nested too deeply"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, fmt, problem):
    good = {"text": "fine"} if fmt == "text" else {"instruction": "i", "output": "o"}
    if fmt == "messages":
        good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    f = _write(tmp_path / "d.jsonl", [good, good, line])
    if problem is None:  # extra keys are ignored when the format is explicit
        assert len(load_examples(f, fmt)) == 3
        return
    with pytest.raises(ValueError, match=problem) as err:
        load_examples(f, fmt)
    assert f"{f}:3" in str(err.value)


def test_first_line_malformed_in_auto_names_line_1(tmp_path):
    f = _write(tmp_path / "d.jsonl", ["{oops", {"text": "fine"}])
    with pytest.raises(ValueError, match=rf"{f}:1: not valid JSON"):
        load_examples(f)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset_refused(tmp_path, content):
    f = tmp_path / "empty.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match="holds no example"):
        load_examples(f, "auto")
    with pytest.raises(ValueError, match="holds no example"):
        load_examples(f, "text")


def test_bad_paths_and_format_refused(tmp_path):
    with pytest.raises(ValueError, match="no such dataset file"):
        load_examples(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"no \*.jsonl or \*.json file"):
        load_examples(tmp_path)
    with pytest.raises(ValueError, match="no dataset path"):
        load_examples([])
    f = _write(tmp_path / "d.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="unknown dataset format 'csv'"):
        load_examples(f, "csv")


def test_a_line_cut_short_names_its_own_column(tmp_path):
    """The column of a JSON error counts within the line: a line cut short fails at its end, not "column 1"
    of the next line (the newline kept when parsing made it so)."""
    line = '{"text": "abc"'
    f = _write(tmp_path / "d.jsonl", [{"text": "fine"}, line])
    with pytest.raises(ValueError, match=rf"{f}:2: not valid JSON at column {len(line) + 1}: "
                                         "Expecting ',' delimiter;"):
        load_examples(f)
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b'{"text": "x"\r\n')
    with pytest.raises(ValueError, match=r"at column 13: "):
        load_examples(crlf)


def test_length_histogram_bins_are_powers_of_two_and_keep_empty_ones():
    from horizon_ray.data.stats import length_histogram

    bins = length_histogram([3, 15, 16, 40, 200])
    assert [(b.lo, b.hi, b.count) for b in bins] == [(0, 16, 2), (16, 32, 1), (32, 64, 1), (64, 128, 0),
                                                     (128, 256, 1)]
    assert length_histogram([]) == []


def test_dataset_stats_without_a_tokenizer_count_examples(tmp_path):
    from horizon_ray.data.stats import dataset_stats

    f = _write(tmp_path / "d.jsonl", [{"text": "a"}, "", {"text": "b"}])
    s = dataset_stats(f)
    assert (s.format, s.examples, s.tokens, s.length_histogram) == ("text", 2, None, [])


def test_dataset_stats_read_the_file_an_example_at_a_time(tmp_path, monkeypatch):
    """An upload's statistics with a tokenizer hold one example at a time, never the whole file: the examples
    are handed to the tokenizer as the file is read."""
    import types

    import horizon_ray.data.stats as stats
    import horizon_ray.data.tokenize as tokenize
    from horizon_ray.data.formats import iter_file

    f = _write(tmp_path / "d.jsonl", [{"text": "a" * n} for n in (3, 20, 40, 300)] + ["{broken"])
    it = iter_file(f)
    assert next(it).text == "aaa"  # read lazily: the broken last line is not reached yet
    seen = []

    class Tok:
        pass

    def tokenize_example(ex, tok):
        seen.append(ex.text)
        return types.SimpleNamespace(input_ids=[0] * len(ex.text), labels=[0] * (len(ex.text) - 1) + [-100])

    monkeypatch.setattr(tokenize, "tokenize_example", tokenize_example)
    with pytest.raises(ValueError, match=r"d.jsonl:5: not valid JSON"):
        stats.dataset_stats(f, "text", Tok())
    assert len(seen) == 4  # every good example was tokenized before the bad line was read
    f.write_text("".join(json.dumps({"text": "a" * n}) + "\n" for n in (3, 20, 40, 300)))
    s = stats.dataset_stats(f, "text", Tok())
    assert (s.examples, s.tokens, s.trained_tokens, s.max_tokens, s.mean_tokens) == (4, 363, 359, 300, 90.8)
    assert [(b.lo, b.hi, b.count) for b in s.length_histogram] == \
        [(b.lo, b.hi, b.count) for b in stats.length_histogram([3, 20, 40, 300])]
