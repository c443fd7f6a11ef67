"""Preference data: a prompt with a chosen and a rejected completion, one pair a line of JSONL.

Two layouts, both the format ``preference`` (``auto`` detects them):
- TRL's and LLaMA-Factory's: ``{"prompt": ..., "chosen": ..., "rejected": ...}``, all three strings (plain
  text: the completions follow the prompt directly, eos appended), or all three message lists (chat: the prompt's
  turns, then the completion's assistant turns, rendered with the tokenizer's chat template as SFT data is);
  or two conversations that repeat the prompt as their first turns (TRL's implicit prompt; UltraFeedback's
  layout adds ``prompt``, their last user turn), the shared turns being the prompt.
- OpenAI's: ``{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}``, the
  outputs lists of assistant messages (chat).

Plain Python, no torch or numpy (the API checks uploads with it); tokenization and the pair sampler are in
``pairs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizon_ray.errors import BadInput

FORMAT = "preference"  # the data.format value of preference files
COMPLETION_ROLES = ("assistant",)
# the two completions of each layout: a record with either one of a couple is a pair (missing its partner)
PAIRED_KEYS = (("chosen", "rejected"), ("preferred_output", "non_preferred_output"))


@dataclass
class PreferencePair:
    """One pair, before tokenization: either three strings or a prompt's turns and two completions' turns."""

    prompt: str | list[dict[str, str]]  # the text before the completions, or the conversation so far
    chosen: str | list[dict[str, str]]  # the preferred completion (assistant turns in chat form)
    rejected: str | list[dict[str, str]]  # the other completion
    source: str  # "file:line"

    @property
    def chat(self) -> bool:
        return isinstance(self.prompt, list)


def is_preference(record: dict[str, Any]) -> bool:
    """Whether a JSONL record is a preference pair (either layout), or meant as one: a record with only one of its
    two completions is a pair that ``parse_pair`` refuses by name, not a record of unknown format."""
    return any(key in record for keys in PAIRED_KEYS for key in keys)


def parse_pair(record: dict[str, Any], where: str, layout: Any = None) -> PreferencePair:
    """The pair of one record; BadInput naming ``where`` and the fix otherwise (``layout``: the SFT formats'
    column names, which preference data does not rename)."""
    for keys in PAIRED_KEYS:
        given = [k for k in keys if k in record]
        if len(given) == 1:
            missing = next(k for k in keys if k not in record)
            raise BadInput(f"{where}: {given[0]!r} without {missing!r}; a preference pair needs both completions "
                           f"({' and '.join(map(repr, keys))}): add {missing!r} or remove the line")
    if "preferred_output" in record:
        inp = record.get("input")
        if not isinstance(inp, dict) or "messages" not in inp:
            raise BadInput(f"{where}: 'input' must be an object with 'messages' (OpenAI's preference format: "
                           "{\"input\": {\"messages\": [...]}, \"preferred_output\": [...], "
                           "\"non_preferred_output\": [...]})")
        prompt = message_list(inp["messages"], where, "input.messages")
        chosen = _completion(record["preferred_output"], where, "preferred_output")
        rejected = _completion(record["non_preferred_output"], where, "non_preferred_output")
        return PreferencePair(prompt, chosen, rejected, where)
    if isinstance(record.get("chosen"), list) and isinstance(record.get("rejected"), list):
        implicit = _implicit_prompt(record, where)
        if implicit is not None:
            return implicit
    if "prompt" not in record:
        raise BadInput(f"{where}: no 'prompt'; give the prompt apart from 'chosen' and 'rejected', or as the "
                       "message lists' common first turns (plain-text conversations that hold their prompt are not "
                       "read)")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        for key in ("prompt", "chosen", "rejected"):
            _text(record.get(key), where, key)
        return PreferencePair(prompt, record["chosen"], record["rejected"], where)
    if isinstance(prompt, list):
        return PreferencePair(message_list(prompt, where, "prompt"), _completion(record["chosen"], where, "chosen"),
                              _completion(record["rejected"], where, "rejected"), where)
    raise BadInput(f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")


def _implicit_prompt(record: dict[str, Any], where: str) -> PreferencePair | None:
    """A pair whose two conversations repeat the prompt as their first turns (TRL's implicit prompt; the
    UltraFeedback layout, whose 'prompt' is that conversation's last user turn): the turns both share are the
    prompt, the rest each completion. None when they share no first turn (the completions only)."""
    chosen = message_list(record["chosen"], where, "chosen")
    rejected = message_list(record["rejected"], where, "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if chosen[0]["role"] in COMPLETION_ROLES or rejected[0]["role"] in COMPLETION_ROLES:
        return None  # an answer first: the completions alone, their prompt in 'prompt'
    if chosen == rejected:
        raise BadInput(f"{where}: 'chosen' and 'rejected' are the same conversation; a pair needs two different "
                       "answers to its prompt")
    parted = [m for m in (chosen[shared:shared + 1] + rejected[shared:shared + 1])
              if m["role"] not in COMPLETION_ROLES]
    if parted or shared in (len(chosen), len(rejected)):
        what = (f"they part at message {shared}, a {parted[0]['role']} turn" if parted else
                "one ends where the other goes on")
        raise BadInput(f"{where}: 'chosen' and 'rejected' hold different prompts ({what}); a pair's two "
                       "completions answer one prompt: give it as their common first turns, or in 'prompt'")
    prompt, turns = chosen[:shared], "the conversations' common first turns"
    given = record.get("prompt")
    if isinstance(given, list) and message_list(given, where, "prompt") not in (prompt, []):
        raise BadInput(f"{where}: 'prompt' differs from {turns}; give the prompt once, or the same in both")
    users = [m["content"] for m in prompt if m["role"] == "user"]
    if isinstance(given, str) and given.strip() and (not users or users[-1].strip() != given.strip()):
        raise BadInput(f"{where}: 'prompt' is not the last user turn of {turns}; give the prompt once, or the "
                       "same in both")
    return PreferencePair(prompt, _completion(chosen[shared:], where, "chosen"),
                          _completion(rejected[shared:], where, "rejected"), where)


def _text(value: Any, where: str, key: str) -> str:
    from horizon_ray.data.formats import _encodable

    if not isinstance(value, str):
        raise BadInput(f"{where}: '{key}' must be a string like 'prompt' (or all three message lists), got "
                       f"{type(value).__name__}")
    _encodable(value, where, f"'{key}'")
    if key != "prompt" and not value.strip():
        raise BadInput(f"{where}: '{key}' is empty; give the completion text or remove the line")
    return value


def message_list(turns: Any, where: str, key: str) -> list[dict[str, str]]:
    """A non-empty list of {role, content} turns (their other keys dropped); BadInput naming the turn."""
    from horizon_ray.data.formats import ROLES, _encodable

    if not isinstance(turns, list) or not turns:
        raise BadInput(f"{where}: '{key}' must be a non-empty list of {{role, content}} objects")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadInput(f"{where}: {key}[{i}] must be an object with 'role' and 'content'")
        if turn.get("role") not in ROLES:
            raise BadInput(f"{where}: {key}[{i}] has role {turn.get('role')!r}; use one of {', '.join(ROLES)}")
        if not isinstance(turn.get("content"), str):
            raise BadInput(f"{where}: {key}[{i}] content must be a string, got {type(turn.get('content')).__name__}")
        _encodable(turn["content"], where, f"{key}[{i}] content")
        messages.append({"role": turn["role"], "content": turn["content"]})
    return messages


def _completion(value: Any, where: str, key: str) -> list[dict[str, str]]:
    """A chat completion: one or more assistant messages."""
    if not isinstance(value, list):
        raise BadInput(f"{where}: '{key}' must be a list of assistant messages like the prompt's, got "
                       f"{type(value).__name__}")
    turns = message_list(value, where, key)
    bad = [m["role"] for m in turns if m["role"] not in COMPLETION_ROLES]
    if bad:
        raise BadInput(f"{where}: '{key}' holds a {bad[0]} message; a completion is the assistant's turns only")
    if not any(m["content"].strip() for m in turns):
        raise BadInput(f"{where}: '{key}' is empty; give the assistant's answer or remove the line")
    return turns


def load_pairs(path: str | Path | list, fmt: str = "auto") -> list[PreferencePair]:
    """Every pair of a JSONL file, a folder of them or a list; BadInput naming file:line for a malformed one, and
    for a file that holds SFT examples instead."""
    from horizon_ray.data.formats import _detect, _expand_paths, _read_lines

    if fmt not in ("auto", FORMAT):
        raise BadInput(f"objective dpo reads preference pairs; data.format is {fmt!r}: set it to {FORMAT} or auto",
                       field="data.format")
    pairs: list[PreferencePair] = []
    for f in _expand_paths(path):
        for lineno, record in _read_lines(f):
            where = f"{f}:{lineno}"
            if not is_preference(record):
                raise BadInput(f"{where}: not a preference pair ({_detect(record, where)} data); objective dpo needs "
                               "{\"prompt\", \"chosen\", \"rejected\"} or OpenAI's {\"input\", \"preferred_output\", "
                               "\"non_preferred_output\"} on every line")
            pairs.append(parse_pair(record, where))
    if not pairs:
        raise BadInput(f"dataset {path} holds no preference pair; add JSONL lines with prompt, chosen and rejected")
    return pairs
