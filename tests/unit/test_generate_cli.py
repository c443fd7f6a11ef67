"""`horizon-ray chat` (stdin piped) and `horizon-ray generate --prompts` on a tiny model with the demo tokenizer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from horizon_ray.engine.generate import Generator
from horizon_ray.engine.sampling import Request, SamplingParams
from tests.tiny import demo_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    """A job's output directory whose final/ holds a tiny model and the demo tokenizer."""
    out = tmp_path_factory.mktemp("job")
    demo_model(out / "final")
    return out


def _cli(*args, stdin=""):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "horizon_ray", *args], input=stdin, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def _answer(job_dir, messages, max_tokens):
    gen = Generator.from_pretrained(job_dir / "final", device="cpu")
    return gen.generate([Request(gen.chat_prompt(messages), SamplingParams(max_tokens=max_tokens))])[0].text


def test_chat_answers_each_line_with_the_conversation_so_far(job_dir):
    r = _cli("chat", str(job_dir), "--max-tokens", "6", "--device", "cpu", stdin="add 1 and 2\ncopy abc\n\n")
    assert r.returncode == 0, r.stderr
    answers = [line.removeprefix("model> ") for line in r.stdout.splitlines() if line.startswith("model> ")]
    first = _answer(job_dir, [{"role": "user", "content": "add 1 and 2"}], 6)
    second = _answer(job_dir, [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": first},
                               {"role": "user", "content": "copy abc"}], 6)
    assert answers == [first, second]


def test_chat_refuses_what_is_not_a_model(tmp_path):
    r = _cli("chat", str(tmp_path / "nothing"), stdin="hi\n")
    assert r.returncode == 2 and "neither a directory nor a job id" in r.stderr


def test_generate_writes_one_answer_per_prompt_in_order(job_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "add 1 and 2"}], "id": 1},
            {"prompt": "copy", "max_tokens": 3, "id": 2},
            {"messages": [{"role": "user", "content": "sort 312"}], "id": 3}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "a.jsonl"
    r = _cli("generate", str(job_dir / "final"), "--prompts", str(prompts), "--out", str(out), "--max-tokens", "5",
             "--batch-size", "2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [1, 2, 3]
    assert got[0]["output"] == _answer(job_dir, rows[0]["messages"], 5)
    assert got[1]["completion_tokens"] <= 3 and got[2]["completion_tokens"] <= 5
    assert all(g["finish_reason"] in ("stop", "length") and g["prompt_tokens"] > 0 for g in got)
    prompts.write_text('{"prompt": "a", "messages": []}\n')
    r = _cli("generate", str(job_dir), "--prompts", str(prompts), "--device", "cpu")
    assert r.returncode == 2 and "p.jsonl:1" in r.stderr
