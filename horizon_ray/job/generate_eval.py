"""Evaluation by generation (``eval.generate``): held-out prompts answered greedily by the job's engine with its
current weights, each answer scored against its reference.

An eval example's prompt is its tokens before its first trained token (for a chat: the turns before the
assistant's answer, with the template's generation prompt), its reference the text of its first run of trained
tokens (the answer, without the eos). The engine generates through its own weight slots
(``Generator.of_engine``): nothing is copied or saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IGNORE = -100


@dataclass(frozen=True)
class HeldOut:
    prompt_ids: tuple[int, ...]
    reference_ids: tuple[int, ...]


def held_out(eval_ds: Any, limit: int) -> list[HeldOut]:
    """The first ``limit`` eval examples that have a prompt and a reference."""
    out = []
    for ex in eval_ds.examples:
        labels, ids = list(ex.labels), list(ex.input_ids)
        first = next((i for i, t in enumerate(labels) if t != IGNORE), None)
        if not first:
            continue
        end = next((i for i in range(first, len(labels)) if labels[i] == IGNORE), len(labels))
        out.append(HeldOut(tuple(ids[:first]), tuple(ids[first:end])))
        if len(out) == limit:
            break
    return out


def score(answer: str, reference: str, metric: str) -> bool:
    a, r = answer.strip(), reference.strip()
    return a == r if metric == "exact_match" else r in a


def evaluate(eng: Any, tokenizer: Any, items: list[HeldOut], max_tokens: int, metric: str,
             batch_size: int) -> tuple[float, list[str]]:
    """(share of ``items`` answered right, the answers) by greedy generation on ``eng``'s newest weights."""
    from horizon_ray.engine.generate import Generator
    from horizon_ray.engine.sampling import Request, SamplingParams

    eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    gen = Generator.of_engine(eng, tokenizer, eos)
    params = SamplingParams(max_tokens=max_tokens)
    answers: list[str] = []
    for lo in range(0, len(items), batch_size):
        batch = items[lo:lo + batch_size]
        answers += [c.text for c in gen.generate([Request(it.prompt_ids, params) for it in batch])]
    refs = [tokenizer.decode(list(it.reference_ids), skip_special_tokens=True) for it in items]
    hits = sum(score(a, r, metric) for a, r in zip(answers, refs))
    return hits / max(1, len(items)), answers
