"""From JSONL paths to the tokenized train and eval splits a job trains and evaluates on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from horizon_ray.data.formats import PLAIN, Example, Layout, load_examples
from horizon_ray.data.shuffle import SPLIT_STREAM, permutation
from horizon_ray.data.tokenize import TokenizedDataset, load_tokenizer, tokenize_examples
from horizon_ray.errors import BadInput

T = TypeVar("T")  # an SFT example or a preference pair

log = logging.getLogger(__name__)

PathLike = str | Path | Sequence[str | Path]


def split_examples(examples: list[T], eval_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Hold out ``round(eval_fraction * n)`` examples (at least one), chosen by ``seed`` alone.

    Both parts keep file order; the choice depends only on (seed, number of examples), so a resumed job
    evaluates on the same held-out examples.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise BadInput(
            f"eval_fraction={eval_fraction} must be in (0, 1), e.g. 0.05; use 0 for no eval split"
        )
    n = len(examples)
    n_eval = max(1, round(eval_fraction * n))
    if n_eval >= n:
        raise BadInput(
            f"eval_fraction={eval_fraction} of {n} examples leaves nothing to train on; lower eval_fraction, "
            "add examples or pass a separate eval_path"
        )
    held_out = set(permutation(n, seed, SPLIT_STREAM)[:n_eval].tolist())
    train = [e for i, e in enumerate(examples) if i not in held_out]
    evals = [e for i, e in enumerate(examples) if i in held_out]
    return train, evals


def build_datasets(
    path: PathLike,
    fmt: str,
    tokenizer: Any,
    seq_len: int,
    eval_fraction: float = 0.0,
    eval_path: PathLike | None = None,
    seed: int = 0,
    layout: Layout = PLAIN,
    train_on_inputs: bool = False,
) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """Load, split and tokenize: ``(train, eval)``; eval is None without eval_fraction and eval_path.

    ``tokenizer`` is a transformers tokenizer or a local folder to load one from (offline). ``fmt`` is
    "auto", "alpaca", "messages", "sharegpt" or "text" and, with ``layout`` (the file's keys and role values),
    applies to ``eval_path`` too; ``train_on_inputs``: a chat's prompts are targets too.
    """
    if eval_path is not None and eval_fraction:
        raise BadInput("give either eval_fraction or eval_path, not both; eval_path is a separate eval set")
    if eval_fraction < 0:
        raise BadInput(f"eval_fraction={eval_fraction} is negative; use a value in [0, 1), e.g. 0.05")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    examples = load_examples(path, fmt, layout)
    eval_examples: list[Example] | None = None
    if eval_path is not None:
        eval_examples = load_examples(eval_path, fmt, layout)
    elif eval_fraction > 0:
        examples, eval_examples = split_examples(examples, eval_fraction, seed)
    train = tokenize_examples(examples, tok, seq_len, train_on_inputs)
    evals = None
    if eval_examples is not None:
        try:
            evals = tokenize_examples(eval_examples, tok, seq_len, train_on_inputs)
        except ValueError as exc:
            where = f"data.eval_path {eval_path}" if eval_path is not None else "the held-out eval split"
            raise BadInput(f"{where}: {exc}") from None
    log.info(
        "dataset: %d train examples (%d tokens), %s eval examples",
        len(train),
        train.num_tokens,
        len(evals) if evals is not None else "no",
    )
    return train, evals
