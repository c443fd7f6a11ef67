"""A generation request (/v1/chat/completions, /v1/completions) out of range is refused before anything is
queued, with OpenAI's 400 naming the request's own parameter, never a 500, and never in the job spec's terms."""

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.testing import make_testbed
from horizon_ray.engine.sampling import SamplingParams
from horizon_ray.errors import BadInput
from horizon_ray.generation import ModelPool
from tests.unit.test_generation_pool import _Recording

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def api():
    """The app in process over a pool whose generator records every batch it is given."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        bed = make_testbed(root)
        bed.settings.model_catalogue = {"m": bed.root / "models" / "1GiB"}
        fake = _Recording()
        pool = ModelPool(load=lambda d: fake)
        with TestClient(create_app(bed.client, bed.settings, generation=pool)) as http:
            yield http, bed.auth(next(iter(bed.keys))), fake
        pool.close()
        bed.close()


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1])
def test_a_seed_beyond_64_bits_is_refused_by_name(seed):
    # before: accepted here, then torch's generator overflowed inside the batch: a 500 for the request and a
    # failed batch for every other request generated with it
    with pytest.raises(BadInput, match="seed must be a 64-bit integer") as exc:
        SamplingParams(seed=seed, temperature=1.0).validate()
    assert exc.value.field == "seed"
    SamplingParams(seed=(1 << 63) - 1).validate()
    SamplingParams(seed=-(1 << 63)).validate()


@pytest.mark.parametrize(("route", "extra", "param", "words"), [
    ("completions", {"prompt": "hi", "seed": 1 << 70, "temperature": 1}, "seed", "64-bit integer"),
    ("chat/completions", {"messages": HI, "max_tokens": 0}, "max_tokens", "max_tokens is 0; set it to 1 or more"),
    ("chat/completions", {"messages": HI, "temperature": 3}, "temperature", "temperature: "),
    ("chat/completions", {"messages": HI, "top_p": 0}, "top_p", "top_p: "),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "is a part of type 'image_url': these models take text only"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content", "must be a string or a list of text parts"),
    ("completions", {"prompt": [1, 2, 3]}, "prompt", "prompt[0]: token-id prompts are not taken; send the text"),
    ("completions", {"prompt": ["a", [1, 2]]}, "prompt", "prompt[1]: token-id prompts are not taken"),
    ("completions", {"prompt": ["a"] * 33}, "prompt", "a list prompt holds 1 to 32 strings, got 33"),
    ("completions", {"prompt": []}, "prompt", "a list prompt holds 1 to 32 strings, got 0"),
    ("completions", {"prompt": ["a", ""]}, "prompt", "prompt[1] must hold 1 to"),
    ("completions", {"prompt": {"text": "a"}}, "prompt", "prompt must be a string, got dict"),
    ("chat/completions", {"messages": HI, "logprobs": True}, "logprobs", "unknown key 'logprobs'"),
])
def test_out_of_range_parameters_get_a_400_naming_the_parameter(api, route, extra, param, words):
    http, auth, fake = api
    before = list(fake.batches)
    r = http.post(f"/v1/{route}", json={"model": "m", **extra}, headers=auth)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]
    # the request's own parameters, not the job spec's sections
    assert "objective" not in err["message"] and "output_dir" not in err["message"]
    if "unknown key" in words:
        assert "max_tokens" in err["message"] and "stop" in err["message"]
    assert fake.batches == before  # nothing reached the model


def test_a_job_spec_body_still_gets_the_job_specs_hints(api):
    http, auth, _ = api
    r = http.post("/finetune", json={"model": {"path": "m"}, "data": {"path": "x"}, "learning_rate": 1e-4},
                  headers=auth)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_spec" and "training.lr" in err["message"] and "objective" in err["message"]


def test_text_parts_are_the_text_they_hold():
    """OpenAI's content parts of type text (what SDKs and many clients send) are the text they hold, joined by
    newlines, on /v1 and in the CLI's chat lines alike (before: refused, 'must be a string')."""
    from api.chat import Message
    from horizon_ray.engine.sampling import chat_turns

    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    assert Message(role="user", content=parts).content == "Name a colour.\nOne word."
    assert chat_turns([{"role": "user", "content": parts}]) == [{"role": "user",
                                                                 "content": "Name a colour.\nOne word."}]
    with pytest.raises(BadInput, match=r"messages\[0\]\.content\[1\] is a part of type 'input_audio'") as exc:
        chat_turns([{"role": "user", "content": [parts[0], {"type": "input_audio", "input_audio": {}}]}])
    assert exc.value.field == "messages[0].content[1]"

