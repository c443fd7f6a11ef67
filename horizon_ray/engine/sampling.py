"""What a generation request asks for and what it gets back: plain data, no torch (the API imports it).

engine/generate.py runs them; horizon_ray/generation.py carries them between the API and the model's worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from horizon_ray.errors import BadInput

# seeds are 64-bit signed integers, as OpenAI's API takes them; torch's generator overflows beyond 2**64 - 1, so a
# larger one would fail the whole batch it joined, everyone's rows with it (the n-th choice is seeded seed + n)
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation ends (OpenAI's fields and meanings)."""

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0: greedy (argmax); else logits / temperature before sampling
    top_p: float = 1.0  # nucleus: sample among the most likely tokens whose probabilities sum to top_p
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    seed: int | None = None  # seeds this request's sampling: the same seed, the same tokens
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise BadInput(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", field="max_tokens")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 2):
            raise BadInput(f"temperature must lie in [0, 2] (0: greedy), got {self.temperature!r}",
                           field="temperature")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise BadInput(f"top_p must lie in (0, 1], got {self.top_p!r}", field="top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadInput(f"top_k must be an integer >= 0 (0: no limit), got {self.top_k!r}", field="top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise BadInput(f"seed must be a 64-bit integer, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}",
                           field="seed")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop) or len(self.stop) > 4:
            raise BadInput(f"stop must be a list of at most 4 non-empty strings, got {self.stop!r}", field="stop")


# the roles of a chat's turns (data files' chat formats take the same)
CHAT_ROLES = ("system", "user", "assistant")


def stop_sequences(stop: object) -> tuple[str, ...]:
    """OpenAI's ``stop``: one string, a list of them, or null (none); a string is one sequence, not its letters."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, (list, tuple)):
        return tuple(stop)
    raise BadInput(f"stop must be a string or a list of strings, got {stop!r}", field="stop")


# the longest message content taken, in characters
MAX_CONTENT_CHARS = 1 << 20


def message_text(content: object, where: str) -> str:
    """A message's content as text: a string, or OpenAI's content parts of type text (``[{"type": "text",
    "text": ...}]``, as SDKs and clients send them) joined by newlines. Other parts (images, audio) are refused:
    these models take text."""
    if isinstance(content, (list, tuple)) and content:
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadInput(f"{where}[{j}] is a part of type {kind!r}: these models take text only; send the "
                               "content as a string or as parts {\"type\": \"text\", \"text\": ...}",
                               field=f"{where}[{j}]")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise BadInput(f"{where} must be a string or a list of text parts, got {content!r}", field=where)
    if len(content) > MAX_CONTENT_CHARS:
        raise BadInput(f"{where} has {len(content):,} characters, more than the {MAX_CONTENT_CHARS:,} taken",
                       field=where)
    return content


def chat_turns(messages: object) -> list[dict[str, str]]:
    """A chat's turns, checked: a non-empty list of {role, content} with a role of CHAT_ROLES and text content
    (``message_text``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise BadInput("messages must be a non-empty list of {role, content} objects", field="messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadInput(f"messages[{i}] must be an object with 'role' and 'content'", field=f"messages[{i}]")
        if m.get("role") not in CHAT_ROLES:
            raise BadInput(f"messages[{i}] has role {m.get('role')!r}; use one of {', '.join(CHAT_ROLES)}",
                           field=f"messages[{i}].role")
        turns.append({"role": m["role"], "content": message_text(m.get("content"), f"messages[{i}].content")})
    return turns


@dataclass(frozen=True)
class Request:
    """One sequence to continue."""

    prompt_ids: tuple[int, ...]  # the prompt's token ids (a chat is rendered by ``chat_prompt`` first)
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Delta:
    """What one step added to one request, for streaming."""

    row: int  # the request's index in the batch
    text: str  # new text that no stop sequence can still take back ("" while held back)
    token_id: int | None  # the token chosen this step; None once the row was finished before
    finish_reason: str | None  # "stop" (eos or a stop sequence), "length" (max_tokens); None: goes on


@dataclass
class Completion:
    """A request's whole result."""

    token_ids: list[int]  # the new tokens (an eos that ended it included, as HF generate returns it)
    text: str  # their text without special tokens, cut before a stop sequence ("" without a tokenizer)
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
