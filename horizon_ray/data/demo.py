"""A small instruction dataset whose answers can be checked exactly, and its per-task score.

Four tasks, short enough that a ~1-5M parameter model with the byte-level demo tokenizer (one token per
character) learns them in a few hundred CPU steps:

    add 3 and 5        -> 8        (single digits: 100 facts)
    copy kqz           -> kqz      (3-4 letters)
    reverse kqz        -> zqk      (3-4 letters)
    sort 3141          -> 1134     (3-4 digits)

``make_demo_preferences`` writes preference pairs of the copy and reverse items (objective dpo).
``make_demo_dataset`` writes JSONL in messages or alpaca form (a ``task`` key rides along and is ignored
by the loader). ``evaluate_demo`` scores a model's answers (the engine's generation: engine/generate.py, or
a job's ``eval.generate``) by exact match, per task.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from horizon_ray.errors import BadInput

DEMO_TASKS = ("add", "copy", "reverse", "sort")

# Letters and digits of the payloads; a short alphabet keeps the tasks learnable by a tiny model.
_LETTERS = string.ascii_lowercase[:12]
_MIN_LEN, _MAX_LEN = 3, 4


@dataclass(frozen=True)
class DemoItem:
    """One demo question with its only correct answer."""

    task: str  # one of DEMO_TASKS
    prompt: str  # the user turn
    answer: str  # the exact expected assistant turn


@dataclass
class DemoScore:
    """Exact-match accuracy of a model's answers on demo items."""

    accuracy: float  # fraction of items answered exactly, in [0, 1]
    n: int  # items scored
    per_task: dict[str, float] = field(default_factory=dict)  # task -> accuracy on that task's items
    predictions: list[str] = field(default_factory=list)  # the model's answers, aligned with the items


def _item(task: str, rng: random.Random) -> DemoItem:
    if task == "add":
        a, b = rng.randrange(10), rng.randrange(10)
        return DemoItem(task, f"add {a} and {b}", str(a + b))
    if task == "sort":
        digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(_MIN_LEN, _MAX_LEN)))
        return DemoItem(task, f"sort {digits}", "".join(sorted(digits)))
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(_MIN_LEN, _MAX_LEN)))
    if task == "copy":
        return DemoItem(task, f"copy {word}", word)
    if task == "reverse":
        return DemoItem(task, f"reverse {word}", word[::-1])
    raise BadInput(f"unknown demo task {task!r}; use some of {', '.join(DEMO_TASKS)}")


def make_demo_items(
    n: int, seed: int, tasks: Sequence[str] = DEMO_TASKS, exclude: Collection[str] = ()
) -> list[DemoItem]:
    """``n`` items, tasks in rotation, a pure function of the arguments.

    Prompts in ``exclude`` are skipped: pass the training prompts to get a held-out set (for copy, reverse
    and sort; 'add' has 100 prompts, which a training set of a few hundred items already covers).
    """
    if n < 1:
        raise BadInput(f"n={n} demo items requested; ask for at least 1")
    if not tasks:
        raise BadInput(f"no demo task given; use some of {', '.join(DEMO_TASKS)}")
    for task in tasks:
        if task not in DEMO_TASKS:
            raise BadInput(f"unknown demo task {task!r}; use some of {', '.join(DEMO_TASKS)}")
    rng = random.Random(seed)
    excluded = set(exclude)
    items: list[DemoItem] = []
    while len(items) < n:
        task = tasks[len(items) % len(tasks)]
        for _ in range(1000):
            item = _item(task, rng)
            if item.prompt not in excluded:
                items.append(item)
                break
        else:
            raise BadInput(
                f"demo task {task!r} has no prompt left outside the {len(excluded)} excluded ones ('add' has "
                "only 100 distinct prompts); leave it out of tasks or exclude fewer prompts"
            )
    return items


def make_demo_dataset(
    path: str | Path, n: int, seed: int, fmt: str = "messages", tasks: Sequence[str] = DEMO_TASKS
) -> Path:
    """Write ``n`` demo items as JSONL (``fmt`` "messages" or "alpaca") to ``path``; returns the path."""
    if fmt not in ("messages", "alpaca"):
        raise BadInput(f"demo format {fmt!r} is not supported; use 'messages' or 'alpaca'")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for item in make_demo_items(n, seed, tasks):
            if fmt == "messages":
                record: dict[str, Any] = {
                    "messages": [
                        {"role": "user", "content": item.prompt},
                        {"role": "assistant", "content": item.answer},
                    ]
                }
            else:
                record = {"instruction": item.prompt, "output": item.answer}
            record["task"] = item.task
            f.write(json.dumps(record) + "\n")
    return out


def make_demo_preferences(path: str | Path, n: int, seed: int, exclude: Collection[str] = ()) -> Path:
    """Write ``n`` checkable preference pairs (copy and reverse items) as JSONL in TRL's conversational form: the
    chosen completion is the item's answer, the rejected one the same answer in capitals, which no demo
    answer ever is; a model that learned the preference ranks the lowercase answer above the capitals on
    prompts it never saw (``exclude``: prompts to leave out, e.g. a training file's)."""
    out = Path(path)
    with out.open("w", encoding="utf-8") as f:
        for item in make_demo_items(n, seed, tasks=("copy", "reverse"), exclude=exclude):
            record = {"prompt": [{"role": "user", "content": item.prompt}],
                      "chosen": [{"role": "assistant", "content": item.answer}],
                      "rejected": [{"role": "assistant", "content": item.answer.upper()}], "task": item.task}
            f.write(json.dumps(record) + "\n")
    return out


def read_demo_items(path: str | Path) -> list[DemoItem]:
    """The items of a file written by ``make_demo_dataset`` (for scoring on its exact prompts)."""
    items = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "messages" in record:
            prompt, answer = record["messages"][0]["content"], record["messages"][1]["content"]
        else:
            prompt, answer = record["instruction"], record["output"]
        items.append(DemoItem(record.get("task", ""), prompt, answer))
    return items


def score_answer(prediction: str, answer: str) -> bool:
    """Exact match, ignoring surrounding whitespace."""
    return prediction.strip() == answer.strip()


def evaluate_demo(items: Sequence[DemoItem], predictions: Sequence[str]) -> DemoScore:
    """Accuracy of ``predictions`` (aligned with ``items``), overall and per task."""
    if len(items) != len(predictions):
        raise BadInput(f"{len(items)} items but {len(predictions)} predictions; pass one answer per item")
    if not items:
        raise BadInput("no demo item to score; make some with make_demo_items")
    hits = [score_answer(p, it.answer) for it, p in zip(items, predictions)]
    per_task: dict[str, float] = {}
    for task in dict.fromkeys(it.task for it in items):
        mine = [h for it, h in zip(items, hits) if it.task == task]
        per_task[task] = sum(mine) / len(mine)
    return DemoScore(sum(hits) / len(hits), len(hits), per_task, list(predictions))
