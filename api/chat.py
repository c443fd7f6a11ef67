"""Try the finished model: ``POST /v1/chat/completions`` and ``POST /v1/completions``, as OpenAI serves them.

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    job = client.fine_tuning.jobs.retrieve(job_id)
    r = client.chat.completions.create(model=job.fine_tuned_model, messages=[{"role": "user", "content": "hi"}])
    for chunk in client.chat.completions.create(model=..., messages=..., stream=True): ...

``model`` is a finished job's ``fine_tuned_model`` (``ft:<model>:<tenant>:<suffix>:<job id>``: its final/
directory, a full model or a LoRA adapter on its base), or a base model of the operator's catalogue. A
tenant sees only its own jobs' models (``GET /v1/models`` lists them): another's is a 404, as a model that
does not exist. Parameters: ``messages`` (chat; the model's chat template renders them) or ``prompt``
(completions), ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k`` (an
extension), ``seed``, ``stop``, ``n``, ``stream``. Streaming answers are server-sent events of
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
    prompt: str = Field(min_length=1, max_length=MAX_CONTENT_CHARS)


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
    return await _answer(request, tenant, body, gen, chat=True)


@router.post("/completions", summary="Continue a prompt with a finished job's model or a catalogue model (OpenAI)")
async def completions(request: Request, body: CompletionRequest, tenant: Annotated[Tenant, Depends(current_tenant)]):
    model_dir, _ = await resolve_model(body.model, tenant)
    gen = GenerationRequest(str(model_dir), body.params(body.max_tokens), n=body.n, prompt=body.prompt)
    return await _answer(request, tenant, body, gen, chat=False)


async def _answer(request: Request, tenant: Tenant, body: _Sampling, gen: GenerationRequest, chat: bool):
    flight = _in_flight(request)
    flight.enter(tenant.name)
    try:
        # the model is loaded (once) and the prompt tokenised here, so that a refusal comes before any stream
        handle: Handle = await run_in_threadpool(request.app.state.generation.submit, gen)
    except BaseException:
        flight.leave(tenant.name)
        raise
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_sse(handle, rid, created, body, chat, lambda: flight.leave(tenant.name)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        events = await _events_while_connected(request, handle)
    finally:
        flight.leave(tenant.name)
    texts, finish, tokens = [""] * body.n, ["length"] * body.n, [0] * body.n
    for ev in events:
        if ev.error:
            raise ApiError(500, "generation_failed", ev.error)
        for d in ev.deltas:
            texts[d.row] += d.text
            tokens[d.row] += d.token_id is not None
            if d.finish_reason:
                finish[d.row] = d.finish_reason
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i], "refusal": None},
                    "finish_reason": finish[i], "logprobs": None} for i in range(body.n)]
    else:
        choices = [{"index": i, "text": texts[i], "finish_reason": finish[i], "logprobs": None} for i in range(body.n)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": body.model, "choices": choices, "system_fingerprint": None,
            "usage": _usage(handle.prompt_tokens, sum(tokens))}


async def _events_while_connected(request: Request, handle: Handle) -> list[Event]:
    """Every event of the request; a client that hangs up meanwhile cancels it (its rows stop, the requests
    queued behind its batch start) and gets nothing."""
    events: list[Event] = []
    while not (events and events[-1].done):
        events += await run_in_threadpool(_events_for, handle, DISCONNECT_CHECK_S)
        if not (events and events[-1].done) and await request.is_disconnected():
            handle.cancel()
            raise ApiError(499, "client_closed_request", "the client closed the connection")
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


async def _sse(handle: Handle, rid: str, created: int, body: _Sampling, chat: bool, done) -> AsyncIterator[bytes]:
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

    finished = False
    try:
        if chat:
            yield chunk([choice(i, "", None, first=True) for i in range(body.n)])
        while True:
            ev: Event = await run_in_threadpool(handle.events.get)
            if ev.error:
                yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error'}})}\n\n".encode()
                finished = True
                break
            for d in ev.deltas:
                tokens += d.token_id is not None
                if d.text:
                    yield chunk([choice(d.row, d.text, None)])
                if d.finish_reason:
                    yield chunk([choice(d.row, None if chat else "", d.finish_reason)])
            if ev.done:
                finished = True
                break
        if (body.stream_options or {}).get("include_usage"):
            yield chunk([], usage=_usage(handle.prompt_tokens, tokens))
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client closed the stream: nobody reads the rest
            handle.cancel()
        done()
