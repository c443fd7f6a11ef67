"""The service side of generation: loaded models, continuous batching of concurrent requests, idle models
unloaded.

``ModelPool`` keeps one ``Generator`` (engine/generate.py) per model directory while it is used. A request is
checked and tokenised when it is submitted (a refusal is a ``BadInput`` before anything streams), then waits
in its model's queue. The model's worker thread runs one ``Session`` (the engine's continuous batch): at every
step boundary the requests waiting join it (as many rows as ``max_batch`` leaves room for), then every row
decodes one token, and each request gets its ``Delta`` steps through its ``Handle``; a request arriving while
others generate starts at the next step instead of waiting for them to end. A model no request used for
``idle_s`` seconds is unloaded (its host and GPU memory freed). A request whose caller is gone (a client that
closed its stream: ``Handle.cancel``) leaves the queue, or the batch at the next step.

The same pool runs in-process (the API's default, tests, the CLI) or inside a Ray actor on a node whose RAM
holds the model (cluster/generation.py); the messages that cross are the dataclasses below.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from horizon_ray.errors import BadInput

# A batch starts this long after its first request, so that requests sent together join together.
GATHER_S = 0.01


@dataclass(frozen=True)
class Limits:
    """What one request may ask of a model."""

    max_tokens: int = 1024  # new tokens per request at most (OpenAI's max_tokens)
    max_context: int = 4096  # prompt + new tokens per request at most
    max_batch: int = 16  # rows of one batch (a request of n choices takes n)
    max_choices: int = 4  # n at most


@dataclass(frozen=True)
class GenerationRequest:
    """One request to a model: exactly one of messages (a chat, rendered by the tokenizer's chat template),
    prompt (text) or prompt_ids."""

    model_dir: str  # the model directory (HF model or PEFT adapter) the request runs on
    params: Any  # engine.generate.SamplingParams
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) of each turn
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    n: int = 1  # choices: n rows, the i-th seeded with seed + i


@dataclass(frozen=True)
class Event:
    """One step of a request's choices, or its end."""

    deltas: tuple = ()  # engine.generate.Delta of each choice that moved (row = the choice's index)
    prompt_tokens: int = 0  # set on the first event
    error: str | None = None  # the batch failed: why (the request ends)
    done: bool = False  # the last event of the request


@dataclass
class Handle:
    """The caller's side of a submitted request: its events, in order, until one is ``done``."""

    prompt_tokens: int
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_cancel: Callable[[], None] | None = None  # tells the side that runs the request (a Ray actor's pool)

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self.events.get()
            yield ev
            if ev.done:
                return

    def cancel(self) -> None:
        """Nobody reads this request any more: it ends (with one last ``done`` event) at the next step."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel()


@dataclass
class _Queued:
    request: GenerationRequest
    rows: list  # engine.generate.Request of each choice
    handle: Handle


class _Model:
    def __init__(self, generator: Any):
        self.generator = generator
        self.pending: list[_Queued] = []
        self.cv = threading.Condition()
        self.last_used = time.monotonic()
        self.busy = False
        self.thread: threading.Thread | None = None


class ModelPool:
    def __init__(self, limits: Limits | None = None, idle_s: float = 600.0,
                 load: Callable[[str], Any] | None = None):
        """``load``: model directory -> Generator (default: Generator.from_pretrained on the best device)."""
        self.limits = limits or Limits()
        self.idle_s = idle_s
        self._load = load or _default_load
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}

    # ---- the caller's side -----------------------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> Handle:
        """Check and tokenise the request, queue it on its model (loaded if need be); its handle."""
        from horizon_ray.engine.sampling import Request

        lim = self.limits
        if not 1 <= req.n <= lim.max_choices:
            raise BadInput(f"n must lie in [1, {lim.max_choices}], got {req.n}", field="n")
        if req.params.max_tokens > lim.max_tokens:
            raise BadInput(f"max_tokens {req.params.max_tokens} is over this service's limit of {lim.max_tokens} "
                           "new tokens per request; ask for fewer", field="max_tokens")
        req.params.validate()
        model = self._model(req.model_dir)
        gen = model.generator
        if req.messages is not None:
            ids = gen.chat_prompt([{"role": r, "content": c} for r, c in req.messages])
        elif req.prompt is not None:
            ids = gen.text_prompt(req.prompt)
        else:
            ids = tuple(req.prompt_ids or ())
        if not ids:
            raise BadInput("the prompt is empty", field="prompt")
        if len(ids) + req.params.max_tokens > lim.max_context:
            raise BadInput(f"{len(ids)} prompt tokens + max_tokens {req.params.max_tokens} are over this service's "
                           f"limit of {lim.max_context} tokens per request; shorten the prompt or lower max_tokens",
                           field="max_tokens")
        seed = req.params.seed
        rows = [Request(tuple(ids), req.params if seed is None or req.n == 1 else replace(req.params, seed=seed + i))
                for i in range(req.n)]
        gen.check(rows)
        handle = Handle(prompt_tokens=len(ids))
        with model.cv:
            model.pending.append(_Queued(req, rows, handle))
            model.last_used = time.monotonic()
            model.cv.notify_all()
        return handle

    def loaded(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def close(self) -> None:
        with self._lock:
            models, self._models = list(self._models.values()), {}
        for m in models:
            with m.cv:
                m.cv.notify_all()

    # ---- models ------------------------------------------------------------------------------------------------

    def _model(self, model_dir: str) -> _Model:
        key = str(Path(model_dir).resolve())
        with self._lock:
            m = self._models.get(key)
            if m is not None:
                m.last_used = time.monotonic()
                return m
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:  # one load of a model at a time; the others wait for it
            with self._lock:
                m = self._models.get(key)
            if m is not None:
                return m
            m = _Model(self._load(key))
            m.thread = threading.Thread(target=self._serve, args=(key, m), name=f"generate:{Path(key).name}",
                                        daemon=True)
            with self._lock:
                self._models[key] = m
            m.thread.start()
            return m

    def _serve(self, key: str, m: _Model) -> None:
        """The model's worker: requests join the running batch at each step, every row decodes, the steps go
        out; unload when idle."""
        batch = _Batch(m.generator.session())
        while True:
            with m.cv:
                while not m.pending and not batch:
                    if self._models.get(key) is not m:
                        return  # closed
                    left = self.idle_s - (time.monotonic() - m.last_used)
                    if left <= 0:
                        with self._lock:
                            if self._models.get(key) is m and not m.pending:
                                del self._models[key]  # unloaded: the generator goes with the last reference
                                return
                        continue
                    m.cv.wait(timeout=min(left, 1.0))
                if self._models.get(key) is not m:
                    batch.fail("the model was unloaded")
                    return
            if not batch:
                time.sleep(GATHER_S)
            with m.cv:
                joining, rows = [], batch.rows()
                while m.pending and (not rows or rows + len(m.pending[0].rows) <= self.limits.max_batch):
                    q = m.pending.pop(0)
                    if q.handle.cancelled.is_set():  # gone before it started
                        q.handle.events.put(Event(done=True))
                        continue
                    joining.append(q)
                    rows += len(q.rows)
                m.busy = True
            try:
                batch.join(joining)
                batch.step()
            except Exception as exc:  # the batch's requests end with the error; the worker goes on
                batch.fail(exc.message if isinstance(exc, BadInput) else f"generation failed: {type(exc).__name__}")
                batch = _Batch(m.generator.session())
            with m.cv:
                m.busy = False
                m.last_used = time.monotonic()


class _Batch:
    """The worker's running batch: the engine's session and the requests whose rows it holds."""

    def __init__(self, session: Any):
        self.session = session
        self.requests: dict[int, _Queued] = {}  # id(request) -> the request
        self.unfinished: dict[int, int] = {}  # id(request) -> its rows still generating

    def __bool__(self) -> bool:
        return bool(self.requests)

    def rows(self) -> int:
        return sum(self.unfinished.values())

    def join(self, joining: list[_Queued]) -> None:
        if not joining:
            return
        for q in joining:
            self.requests[id(q)] = q
            self.unfinished[id(q)] = len(q.rows)
            q.handle.events.put(Event(prompt_tokens=q.handle.prompt_tokens))
        keys = [(id(q), i) for q in joining for i in range(len(q.rows))]
        self._hand_out(self.session.admit([r for q in joining for r in q.rows], keys))

    def step(self) -> None:
        gone = [rid for rid, q in self.requests.items() if q.handle.cancelled.is_set()]
        if gone:
            self.session.cancel([(rid, i) for rid in gone for i in range(len(self.requests[rid].rows))])
            for rid in gone:
                self._end(rid)
        if self.requests and len(self.session):
            self._hand_out(self.session.step())

    def fail(self, message: str) -> None:
        for q in self.requests.values():
            q.handle.events.put(Event(error=message, done=True))
        self.requests.clear()
        self.unfinished.clear()

    def _hand_out(self, steps: list) -> None:
        by_request: dict[int, list] = {}
        for (rid, i), d in steps:
            if rid in self.requests and (d.token_id is not None or d.text):
                by_request.setdefault(rid, []).append(replace(d, row=i))
        for rid, deltas in by_request.items():
            q = self.requests[rid]
            if not q.handle.cancelled.is_set():
                q.handle.events.put(Event(deltas=tuple(deltas)))
            self.unfinished[rid] -= sum(d.finish_reason is not None for d in deltas)
            if not self.unfinished[rid]:
                self._end(rid)

    def _end(self, rid: int) -> None:
        self.requests.pop(rid).handle.events.put(Event(done=True))
        del self.unfinished[rid]


def _default_load(model_dir: str) -> Any:
    from horizon_ray.engine.generate import Generator

    return Generator.from_pretrained(model_dir, device="auto")
