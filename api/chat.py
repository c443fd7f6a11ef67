"""Try the finished model: ``POST /v1/chat/completions`` and ``POST /v1/completions``, as OpenAI serves them.

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    job = client.fine_tuning.jobs.retrieve(job_id)
    r = client.chat.completions.create(model=job.fine_tuned_model, messages=[{"role": "user", "content": "hi"}])
    for chunk in client.chat.completions.create(model=..., messages=..., stream=True): ...

``model`` is a finished job's ``fine_tuned_model`` (``ft:<model>:<tenant>:<suffix>:<job id>``: its final/
directory, a full model or a LoRA adapter on its base), or a base model of the operator's catalogue. A
tenant sees only its own jobs' models (``GET /v1/models`` lists them): another's is a 404, as a model that
does not exist. Parameters: ``messages`` (chat; the model's chat template renders them) or ``prompt``
(completions: a string, or a list of up to MAX_PROMPTS strings, whose choices come prompt by prompt: index
``prompt x n + j``, as OpenAI numbers them), ``max_tokens`` (or ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k`` (an extension), ``seed``, ``stop``, ``n``, ``stream``. Streaming answers are server-sent events of
``chat.completion.chunk`` (or ``text_completion``) objects ending with ``data: [DONE]``, as OpenAI's are.

Generation runs in the app's generation backend (``app.state.generation``: an in-process ``ModelPool``, or
the cluster's generation actors), which batches concurrent requests and checks the per-request token limits;
this module adds the tenant's requests-in-flight limit (429 beyond it).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool

from api.auth import Tenant, current_tenant
from api.errors import ApiError
from api.openai import ERRORS, PREFIX, resolve_model
from horizon_ray.engine.sampling import MAX_CONTENT_CHARS, SamplingParams, message_text, stop_sequences
from horizon_ray.generation import Event, GenerationRequest, Handle

DISCONNECT_CHECK_S = 0.5  # how often a request without a stream checks that its client is still there

router = APIRouter(prefix=PREFIX, tags=["openai"], responses=ERRORS)

# requests of one tenant being generated at once, at most (more: 429)
MAX_IN_FLIGHT = 8
# prompts of one /v1/completions request, at most (each is a generation request of n choices)
MAX_PROMPTS = 32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str  # a string, or text parts (sampling.message_text: joined before the model sees them)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> str:
        return message_text(content, "content")


class _Sampling(_Strict):
    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="horizon-ray's extension: sample among the k most likely tokens")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    def params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens or 16, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=stop_sequences(self.stop))


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> str | list[str]:
        """A string or a list of strings, each non-empty and within the content limit; token-id prompts are
        refused by name (the service tokenizes with the model's own tokenizer)."""
        many = isinstance(prompt, list)
        if many and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]  # one prompt of token ids: refused below as such
        items = prompt if many else [prompt]
        if many and not 1 <= len(items) <= MAX_PROMPTS:
            raise ValueError(f"a list prompt holds 1 to {MAX_PROMPTS} strings, got {len(items)}; send the rest in "
                             "another request")
        for i, p in enumerate(items):
            where = f"prompt[{i}]" if many else "prompt"
            if isinstance(p, int) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
                raise ValueError(f"{where}: token-id prompts are not taken; send the text (the service tokenizes "
                                 "it with the model's tokenizer)")
            if not isinstance(p, str):
                raise ValueError(f"{where} must be a string, got {type(p).__name__}")
            if not 1 <= len(p) <= MAX_CONTENT_CHARS:
                raise ValueError(f"{where} must hold 1 to {MAX_CONTENT_CHARS} characters, got {len(p)}")
        return prompt

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class _InFlight:
    """Requests of each tenant being generated."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, tenant: str) -> None:
        with self._lock:
            if self._n.get(tenant, 0) >= MAX_IN_FLIGHT:
                raise ApiError(429, "too_many_requests", f"{MAX_IN_FLIGHT} of your requests are being generated "
                               "already; wait for one to finish", headers={"Retry-After": "1"})
            self._n[tenant] = self._n.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        with self._lock:
            self._n[tenant] -= 1


def _in_flight(request: Request) -> _InFlight:
    state = request.app.state
    if getattr(state, "chat_in_flight", None) is None:
        state.chat_in_flight = _InFlight()
    return state.chat_in_flight


@router.post("/chat/completions", summary="Chat with a finished job's model or a catalogue model (OpenAI)")
async def chat_completions(request: Request, body: ChatRequest, tenant: Annotated[Tenant, Depends(current_tenant)]):
    model_dir, _ = await resolve_model(body.model, tenant)
    max_tokens = body.max_completion_tokens or body.max_tokens
    gen = GenerationRequest(str(model_dir), body.params(max_tokens), n=body.n,
                            messages=tuple((m.role if m.role != "developer" else "system", m.content)
                                           for m in body.messages))
    return await _answer(request, tenant, body, [gen], chat=True)


@router.post("/completions", summary="Continue a prompt with a finished job's model or a catalogue model (OpenAI)")
async def completions(request: Request, body: CompletionRequest, tenant: Annotated[Tenant, Depends(current_tenant)]):
    model_dir, _ = await resolve_model(body.model, tenant)
    gens = [GenerationRequest(str(model_dir), body.params(body.max_tokens), n=body.n, prompt=p)
            for p in body.prompts()]
    return await _answer(request, tenant, body, gens, chat=False)


async def _answer(request: Request, tenant: Tenant, body: _Sampling, gens: list[GenerationRequest], chat: bool):
    """One generation request per prompt (a chat: one), submitted together so that the backend batches them;
    choice ``h x n + row`` is row ``row`` of request ``h``."""
    flight = _in_flight(request)
    flight.enter(tenant.name)
    handles: list[Handle] = []
    try:
        # the model is loaded (once) and each prompt tokenised here, so that a refusal comes before any stream
        for gen in gens:
            handles.append(await run_in_threadpool(request.app.state.generation.submit, gen))
    except BaseException:
        for submitted in handles:  # a later prompt was refused: the earlier ones stop
            submitted.cancel()
        flight.leave(tenant.name)
        raise
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_sse(handles, rid, created, body, chat, lambda: flight.leave(tenant.name)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        events = await _events_while_connected(request, handles)
    finally:
        flight.leave(tenant.name)
    choices_n = body.n * len(handles)
    texts, finish, tokens = [""] * choices_n, ["length"] * choices_n, [0] * choices_n
    for h, ev in events:
        if ev.error:
            raise ApiError(500, "generation_failed", ev.error)
        for d in ev.deltas:
            i = h * body.n + d.row
            texts[i] += d.text
            tokens[i] += d.token_id is not None
            if d.finish_reason:
                finish[i] = d.finish_reason
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i], "refusal": None},
                    "finish_reason": finish[i], "logprobs": None} for i in range(choices_n)]
    else:
        choices = [{"index": i, "text": texts[i], "finish_reason": finish[i], "logprobs": None}
                   for i in range(choices_n)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": body.model, "choices": choices, "system_fingerprint": None,
            "usage": _usage(sum(handle.prompt_tokens for handle in handles), sum(tokens))}


async def _events_while_connected(request: Request, handles: list[Handle]) -> list[tuple[int, Event]]:
    """Every event of the requests, with the index of its request; a client that hangs up meanwhile cancels
    them (their rows stop, the requests queued behind their batch start) and gets nothing."""
    events: list[tuple[int, Event]] = []
    for h, handle in enumerate(handles):
        mine: list[Event] = []
        while not (mine and mine[-1].done):
            mine += await run_in_threadpool(_events_for, handle, DISCONNECT_CHECK_S)
            if not (mine and mine[-1].done) and await request.is_disconnected():
                for other in handles:
                    other.cancel()
                raise ApiError(499, "client_closed_request", "the client closed the connection")
        events += [(h, ev) for ev in mine]
    return events


def _events_for(handle: Handle, seconds: float) -> list[Event]:
    """The request's events that come within ``seconds``, up to its last."""
    out: list[Event] = []
    deadline = time.monotonic() + seconds
    while not (out and out[-1].done) and (left := deadline - time.monotonic()) > 0:
        try:
            out.append(handle.events.get(timeout=left))
        except queue.Empty:
            break
    return out


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _next_events(handles: list[Handle], finished: set[int]) -> list[tuple[int, Event]]:
    """The events the unfinished requests have now, each with its request's index; when none has any, the next
    event of one of them."""
    while True:
        out: list[tuple[int, Event]] = []
        for h, handle in enumerate(handles):
            while h not in finished:
                try:
                    ev = handle.events.get_nowait()
                except queue.Empty:
                    break
                out.append((h, ev))
                if ev.done:
                    break
        if out:
            return out
        first = min(set(range(len(handles))) - finished)
        try:
            return [(first, handles[first].events.get(timeout=0.05))]
        except queue.Empty:
            continue


async def _sse(handles: list[Handle], rid: str, created: int, body: _Sampling, chat: bool,
               done) -> AsyncIterator[bytes]:
    """OpenAI's stream: one chunk per choice and step (the first chat chunk of a choice carries the role), a
    last chunk per choice with its finish_reason, then [DONE]; with stream_options.include_usage a usage chunk."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    tokens = 0

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": rid, "object": obj, "created": created, "model": body.model, "choices": choices,
                "system_fingerprint": None, **extra}
        return f"data: {json.dumps(data)}\n\n".encode()

    def choice(i: int, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}

    ended: set[int] = set()
    failed = False
    try:
        if chat:
            yield chunk([choice(i, "", None, first=True) for i in range(body.n)])
        while len(ended) < len(handles) and not failed:
            for h, ev in await run_in_threadpool(_next_events, handles, ended):
                if ev.error:
                    yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error'}})}\n\n".encode()
                    failed = True
                    break
                for d in ev.deltas:
                    i = h * body.n + d.row
                    tokens += d.token_id is not None
                    if d.text:
                        yield chunk([choice(i, d.text, None)])
                    if d.finish_reason:
                        yield chunk([choice(i, None if chat else "", d.finish_reason)])
                if ev.done:
                    ended.add(h)
        if (body.stream_options or {}).get("include_usage"):
            yield chunk([], usage=_usage(sum(handle.prompt_tokens for handle in handles), tokens))
        yield b"data: [DONE]\n\n"
    finally:
        for h, handle in enumerate(handles):
            if h not in ended:  # the client closed the stream, or another prompt failed: nobody reads the rest
                handle.cancel()
        done()
