"""/v1/chat/completions and /v1/completions through the real `openai` SDK, unchanged, against a real uvicorn on
127.0.0.1 over the coordinator's in-process twin and the in-process generation pool.

The catalogue's base model is a real tiny Llama with the demo tokenizer (its chat template); a finished job's
final/ holds the model the job "trained" (the fake agents write none: the test puts the full model there for
one job and a PEFT adapter on the base for another, as the runner would). What the SDK gets back equals what
the engine's generator makes of the same prompt.
"""

from __future__ import annotations

import shutil

import openai
import pytest
import torch

from api import chat
from api.app import create_app
from api.server import running_server
from api.testing import make_testbed
from horizon_ray.engine.generate import Generator, Request, SamplingParams
from tests.integration.test_openai_sdk import jsonl, sdk, wait_for
from tests.tiny import catalogue_model

pytestmark = pytest.mark.integration
HI = [{"role": "user", "content": "add 2 and 3"}]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    bed = make_testbed(root, tenants=("acme", "globex"), quotas={"default": {"max_concurrent_jobs": 8}})
    catalogue_model(bed)
    yield bed
    bed.close()


@pytest.fixture(scope="module")
def url(bed):
    with running_server(create_app(bed.client, bed.settings)) as url:
        yield url


def _finished_job(url, bed, suffix: str, tenant="acme"):
    client = sdk(url, bed, tenant)
    train = client.files.create(file=("train.jsonl", jsonl(8)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="tiny-1g", training_file=train.id, suffix=suffix,
                                         extra_body={"spec": {"training": {"max_steps": 2, "seq_len": 64}}})
    done = wait_for(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status == "succeeded" and j)
    return done, bed.client.get(tenant, job.id).output_dir


@pytest.fixture(scope="module")
def full_job(url, bed):
    """A finished job whose final/ is a full model: the base with its weights perturbed."""
    from safetensors.torch import load_file, save_file

    job, out = _finished_job(url, bed, "full")
    final = shutil.copytree(bed.settings.model_catalogue["tiny-1g"], f"{out}/final")
    weights = load_file(f"{final}/model.safetensors")
    g = torch.Generator().manual_seed(3)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              f"{final}/model.safetensors", metadata={"format": "pt"})
    return job


@pytest.fixture(scope="module")
def lora_job(url, bed):
    """A finished LoRA job: final/ holds a PEFT adapter on the catalogue's base (and the tokenizer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    job, out = _finished_job(url, bed, "lora")
    base = bed.settings.model_catalogue["tiny-1g"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(f"{out}/final")
    for f in base.glob("tokenizer*"):
        shutil.copy(f, f"{out}/final/")
    return job


def _expected(model_dir, messages=None, prompt=None, **params) -> tuple[str, str]:
    gen = Generator.from_pretrained(model_dir, device="cpu")
    ids = gen.chat_prompt(messages) if messages is not None else gen.text_prompt(prompt)
    c = gen.generate([Request(ids, SamplingParams(**params))])[0]
    return c.text, c.finish_reason


def test_chat_with_a_finished_job_model_equals_the_engine(url, bed, full_job):
    client = sdk(url, bed)
    r = client.chat.completions.create(model=full_job.fine_tuned_model, messages=HI, max_tokens=12, temperature=0)
    want, finish = _expected(bed.client.get("acme", full_job.id).output_dir + "/final", HI, max_tokens=12)
    assert r.object == "chat.completion" and r.model == full_job.fine_tuned_model
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    base = client.chat.completions.create(model="tiny-1g", messages=HI, max_tokens=12, temperature=0)
    assert base.choices[0].message.content == _expected(bed.settings.model_catalogue["tiny-1g"], HI, max_tokens=12)[0]
    assert base.choices[0].message.content != want  # the job's weights, not the base's


def test_streaming_chat_sends_the_same_text_in_chunks(url, bed, full_job):
    client = sdk(url, bed)
    chunks = list(client.chat.completions.create(model=full_job.fine_tuned_model, messages=HI, max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want, finish = _expected(bed.client.get("acme", full_job.id).output_dir + "/final", HI, max_tokens=12)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices


def test_a_lora_job_serves_its_adapter_on_the_base(url, bed, lora_job):
    client = sdk(url, bed)
    r = client.chat.completions.create(model=lora_job.fine_tuned_model, messages=HI, max_tokens=10, temperature=0)
    want, _ = _expected(bed.client.get("acme", lora_job.id).output_dir + "/final", HI, max_tokens=10)
    assert r.choices[0].message.content == want


def test_completions_with_stop_and_seeded_sampling(url, bed, full_job):
    client = sdk(url, bed)
    final = bed.client.get("acme", full_job.id).output_dir + "/final"
    plain, _ = _expected(final, prompt="copy abc", max_tokens=10)
    r = client.completions.create(model=full_job.fine_tuned_model, prompt="copy abc", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == plain
    if len(plain) >= 3:  # a stop sequence from inside the text cuts it there
        stop = plain[1:3]
        cut = client.completions.create(model=full_job.fine_tuned_model, prompt="copy abc", max_tokens=10,
                                        temperature=0, stop=[stop])
        assert cut.choices[0].text == plain[:plain.find(stop)] and cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=full_job.fine_tuned_model, prompt="copy abc", max_tokens=10,
                                      temperature=1.0, seed=11, n=2) for _ in range(2))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    streamed = client.completions.create(model=full_job.fine_tuned_model, prompt="copy abc", max_tokens=10,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain


def test_a_list_of_prompts_gets_n_choices_each_numbered_prompt_by_prompt(url, bed, full_job):
    """OpenAI's completions take a list of prompts (what batch clients and eval harnesses send): choice
    p x n + j is the j-th of prompt p, each equal to what the engine makes of that prompt alone, streamed or
    not (before: refused, 'prompt must be a string')."""
    client = sdk(url, bed)
    final = bed.client.get("acme", full_job.id).output_dir + "/final"
    prompts = ["copy abc", "add 2 and 3", "copy xyz"]
    expected = [_expected(final, prompt=p, max_tokens=8) for p in prompts]
    r = client.completions.create(model=full_job.fine_tuned_model, prompt=prompts, max_tokens=8, temperature=0,
                                  n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [(c.text, c.finish_reason) for c in r.choices] == [e for e in expected for _ in range(2)]
    alone = [client.completions.create(model=full_job.fine_tuned_model, prompt=p, max_tokens=8, temperature=0)
             for p in prompts]
    # every prompt's tokens counted once, every choice's completion
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    streamed = client.completions.create(model=full_job.fine_tuned_model, prompt=prompts, max_tokens=8,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    texts, finish, usage = [""] * 3, [None] * 3, None
    for chunk in streamed:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert list(zip(texts, finish)) == expected
    assert usage is not None and usage.prompt_tokens == r.usage.prompt_tokens


def test_tenants_see_only_their_own_models(url, bed, full_job):
    other = sdk(url, bed, "globex")
    with pytest.raises(openai.NotFoundError) as info:
        other.chat.completions.create(model=full_job.fine_tuned_model, messages=HI, max_tokens=4)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    forged = full_job.fine_tuned_model.replace(":acme:", ":globex:")
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(model=forged, messages=HI, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        sdk(url, bed).chat.completions.create(model="ft:tiny-1g:acme:x:job-0000", messages=HI, max_tokens=4)
    with pytest.raises(openai.NotFoundError) as info:
        sdk(url, bed).completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert "tiny-1g" in info.value.body["message"]


def test_limits_on_tokens_and_requests_in_flight(url, bed, monkeypatch):
    client = sdk(url, bed)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-1g", messages=HI, max_tokens=10**5)
    assert info.value.body["param"] == "max_tokens" and "limit" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-1g", messages=HI, max_tokens=250)  # over the 256 positions
    assert info.value.body["param"] == "max_tokens"
    monkeypatch.setattr(chat, "MAX_IN_FLIGHT", 0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="tiny-1g", messages=HI, max_tokens=4)
    monkeypatch.setattr(chat, "MAX_IN_FLIGHT", 1)
    for _ in range(3):  # each finished request gave its place back
        client.chat.completions.create(model="tiny-1g", messages=HI, max_tokens=2)
    list(client.completions.create(model="tiny-1g", prompt="a", max_tokens=2, stream=True))

    def another():  # the stream's place is given back once the server has sent its end
        try:
            return client.chat.completions.create(model="tiny-1g", messages=HI, max_tokens=2)
        except openai.RateLimitError:
            return None

    wait_for(another, timeout=60)  # a condition: a busy machine may take a while to send the end


def test_models_lists_the_tenants_fine_tuned_models_beside_the_catalogue(url, bed, full_job, lora_job):
    """GET /v1/models: the catalogue's base models, then the tenant's servable ft: models (succeeded, final/ here),
    newest first; never another tenant's. GET /v1/models/{id} answers for exactly those."""
    theirs, out = _finished_job(url, bed, "theirs", tenant="globex")
    shutil.copytree(bed.settings.model_catalogue["tiny-1g"], f"{out}/final")
    unsaved, _ = _finished_job(url, bed, "no-final")  # succeeded, but its final/ is not on this storage
    acme, globex = sdk(url, bed), sdk(url, bed, "globex")

    listed = list(acme.models.list())
    assert [m.id for m in listed] == ["tiny-1g", lora_job.fine_tuned_model, full_job.fine_tuned_model]
    assert [m.owned_by for m in listed] == ["horizon-ray", "acme", "acme"]
    assert listed[2].created == full_job.finished_at
    assert [m.id for m in globex.models.list()] == ["tiny-1g", theirs.fine_tuned_model]
    assert unsaved.fine_tuned_model not in {m.id for m in listed}

    one = acme.models.retrieve(full_job.fine_tuned_model)
    assert (one.id, one.object, one.owned_by, one.created) == (full_job.fine_tuned_model, "model", "acme",
                                                              full_job.finished_at)
    assert acme.models.retrieve("tiny-1g").owned_by == "horizon-ray"
    for client, name in ((globex, full_job.fine_tuned_model), (acme, theirs.fine_tuned_model),
                         (acme, unsaved.fine_tuned_model), (acme, "no-such-model")):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(name)
        assert info.value.body["code"] == "model_not_found", name
    # what the list names, chat serves
    r = globex.chat.completions.create(model=theirs.fine_tuned_model, messages=HI, max_tokens=3, temperature=0)
    assert r.model == theirs.fine_tuned_model
