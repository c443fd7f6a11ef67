"""build_datasets: a held-out split that is disjoint, complete and seeded; eval_path; refusals."""

import json

import pytest

from horizon_ray.data import build_datasets, build_demo_tokenizer, load_examples, split_examples


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_demo_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(
        "".join(json.dumps({"instruction": f"copy {i}", "output": str(i)}) + "\n" for i in range(40))
    )
    return f


def _answers(ds, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    return [tok.decode([t for t in e.labels if t >= 0], skip_special_tokens=True) for e in ds.examples]


def test_eval_split_is_disjoint_complete_and_seeded(data, tok_dir):
    train, ev = build_datasets(data, "auto", tok_dir, 64, eval_fraction=0.1, seed=5)
    a, b = _answers(train, tok_dir), _answers(ev, tok_dir)
    assert (len(a), len(b)) == (36, 4)
    assert not set(a) & set(b) and sorted(a + b, key=int) == [str(i) for i in range(40)]
    train2, ev2 = build_datasets(data, "alpaca", tok_dir, 64, eval_fraction=0.1, seed=5)
    assert _answers(ev2, tok_dir) == b and train2.examples == train.examples
    _, ev3 = build_datasets(data, "auto", tok_dir, 64, eval_fraction=0.1, seed=6)
    assert _answers(ev3, tok_dir) != b


def test_split_keeps_file_order_and_at_least_one_eval(data):
    ex = load_examples(data)
    train, ev = split_examples(ex, 0.001, seed=0)
    assert len(ev) == 1 and len(train) == 39
    lines = [int(e.source.rsplit(":", 1)[1]) for e in train]
    assert lines == sorted(lines)
    with pytest.raises(ValueError, match="leaves nothing to train on"):
        split_examples(ex[:1], 0.5, seed=0)
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        split_examples(ex, 1.0, seed=0)


def test_eval_path_and_no_eval(data, tok_dir, tmp_path):
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"text": "held out text"}) + "\n")
    train, ev = build_datasets(data, "auto", tok_dir, 64, eval_path=other)
    assert len(train) == 40 and len(ev) == 1 and ev.examples[0].labels[1:] == ev.examples[0].input_ids[1:]
    train, ev = build_datasets(data, "auto", tok_dir, 64)
    assert len(train) == 40 and ev is None
    with pytest.raises(ValueError, match="not both"):
        build_datasets(data, "auto", tok_dir, 64, eval_fraction=0.1, eval_path=other)


def test_empty_dataset_and_missing_tokenizer_refused(tmp_path, tok_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no example"):
        build_datasets(empty, "auto", tok_dir, 64)
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="is not a folder"):
        build_datasets(f, "auto", tmp_path / "nowhere", 64)
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        build_datasets(f, "auto", tmp_path, 64)


def test_an_eval_set_with_nothing_to_score_names_the_eval_set(data, tok_dir, tmp_path):
    # prompts so long that no answer token fits seq_len: the error says which set it is
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"instruction": "x " * 200, "output": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"data.eval_path .*eval.jsonl: none of the 1 examples has a target token"):
        build_datasets(data, "auto", tok_dir, 64, eval_path=other)
