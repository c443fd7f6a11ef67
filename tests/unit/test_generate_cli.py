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


def _generate_in_process(capsys, model, lines, *extra):
    """`horizon-ray generate` in this process over a file of ``lines``: (exit code, answers, stderr)."""
    from horizon_ray.cli import main

    prompts = Path(model).parent / "lines.jsonl"
    prompts.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    code = main(["generate", str(model), "--prompts", str(prompts), "--device", "cpu", *extra])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def test_a_lines_stop_string_and_openai_names_mean_what_the_api_takes(job_dir, capsys):
    """``stop: "ab"`` is one stop sequence (before: its letters, each a sequence of its own), null is the command
    line's default (before: a TypeError for stop), max_completion_tokens is max_tokens, as in /v1."""
    gen = Generator.from_pretrained(job_dir / "final", device="cpu")
    # a prompt whose greedy answer has two characters that first occur together at k, one of them alone before
    # k: the stop string read as its letters would end the answer earlier
    for prompt in ("add 1 and 2", "reverse hello", "sort 312", "copy abc"):
        text = gen.generate([Request(gen.text_prompt(prompt), SamplingParams(max_tokens=32))])[0].text
        k = next((k for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k
                  and "\ufffd" not in text[k:k + 2] and (text[k] in text[:k] or text[k + 1] in text[:k])), None)
        if k is not None:
            break
    assert k is not None, "no answer of the tiny model has such a stop string"
    stop = text[k:k + 2]
    code, got, err = _generate_in_process(capsys, job_dir / "final", [
        {"prompt": prompt, "max_tokens": 32, "stop": stop},
        {"prompt": prompt, "max_tokens": 32, "stop": [stop]},
        {"prompt": prompt, "max_completion_tokens": 3, "stop": None, "seed": None, "id": "x"}])
    assert code == 0, err
    assert [g["output"] for g in got[:2]] == [text[:k], text[:k]]
    assert got[0]["finish_reason"] == got[1]["finish_reason"] == "stop"
    assert got[2]["completion_tokens"] == 3 and got[2]["finish_reason"] == "length" and got[2]["id"] == "x"


@pytest.mark.parametrize(("line", "words"), [
    ({"messages": "hi"}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0] has role 'robot'"),
    ({"prompt": 3}, "prompt must be a string"),
    ({"prompt": "x", "stop": 5}, "stop must be a string or a list"),
    ({"prompt": "x", "n": 2}, "'n' is not taken by generate"),
    ({"prompt": "x", "max_token": 2}, "did you mean 'max_tokens'"),
    ({"prompt": "x", "seed": 1 << 64}, "seed must be a 64-bit integer"),
])
def test_a_bad_line_is_refused_with_its_line_before_anything_runs(job_dir, capsys, line, words):
    # before: raw tracebacks (TypeError, jinja2's TemplateError, the tokenizer's ValueError), or n and a
    # misspelt max_token copied to the answer and ignored
    code, got, err = _generate_in_process(capsys, job_dir / "final", [{"prompt": "copy abc", "max_tokens": 2}, line])
    assert code == 2 and got == []
    assert "lines.jsonl:2: " in err and words in err and "Traceback" not in err


def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_messages(job_dir):
    """A template's own refusal (Mistral's and Llama 2's "roles must alternate") is the request's fault: a 400
    naming messages before anything is queued, never a 500."""
    import tempfile

    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.testing import make_testbed
    from horizon_ray.generation import ModelPool

    gen = Generator.from_pretrained(job_dir / "final", device="cpu")
    gen.tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles "
                                   "must alternate user/assistant/user/assistant/...') }}{% endif %}"
                                   "{{ messages[0]['content'] }}")
    with tempfile.TemporaryDirectory() as root:
        bed = make_testbed(root)
        bed.settings.model_catalogue = {"m": bed.root / "models" / "1GiB"}
        pool = ModelPool(load=lambda d: gen)
        with TestClient(create_app(bed.client, bed.settings, generation=pool)) as http:
            body = {"model": "m", "max_tokens": 2, "messages": [{"role": "system", "content": "be brief"}]}
            r = http.post("/v1/chat/completions", json=body, headers=bed.auth(next(iter(bed.keys))))
            ok = http.post("/v1/chat/completions", headers=bed.auth(next(iter(bed.keys))),
                           json={**body, "messages": [{"role": "user", "content": "copy abc"}]})
        pool.close()
        bed.close()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "chat template refuses these messages" in err["message"]
    assert "roles must alternate" in err["message"]
    assert ok.status_code == 200


@pytest.mark.parametrize(("where", "words"), [
    ("nodir/answers.jsonl", "is in no existing directory"), (".", "is a directory")])
def test_an_out_path_that_cannot_be_written_is_refused_before_the_model_loads(job_dir, capsys, monkeypatch, where,
                                                                               words):
    # before: a FileNotFoundError / IsADirectoryError traceback once the model had loaded
    from horizon_ray.commands import chat

    monkeypatch.setattr(chat, "load", lambda *a: pytest.fail("the model loaded"))
    code, _, err = _generate_in_process(capsys, job_dir / "final", [{"prompt": "x"}], "--out",
                                        str(job_dir / where))
    assert code == 2 and f"--out {job_dir / where} {words}" in err and "Traceback" not in err


def test_prompts_that_are_not_utf8_are_refused_by_name(job_dir, capsys):
    prompts = job_dir / "latin1.jsonl"
    prompts.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    from horizon_ray.cli import main

    assert main(["generate", str(job_dir / "final"), "--prompts", str(prompts), "--device", "cpu"]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_chat_says_why_a_turn_cannot_run_and_goes_on_with_the_conversation(job_dir, capsys, monkeypatch):
    """A turn the model cannot take (here: past its 256 positions with --max-tokens 200) is refused with the
    reason, and the next turn is answered on the conversation without it (before: the session ended)."""
    import io

    from horizon_ray.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("copy " + "x" * 100 + "\ncopy abc\n\n"))
    assert main(["chat", str(job_dir), "--max-tokens", "200", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "exceed the model's context of 256 positions" in err
    assert out.count("model> ") == 1  # one answer: the second turn's, on a conversation of it alone
    assert f"model> {_answer(job_dir, [{'role': 'user', 'content': 'copy abc'}], 200)}\n" in out
