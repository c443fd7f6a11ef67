"""Datasets, tokenizer, chat templates and packing: JSONL on disk -> micro-batches for ``Engine.train_step``.

    train, eval = build_datasets(path, fmt, tokenizer, seq_len, eval_fraction=0.05, eval_path=None, seed=0)
        # path: a .jsonl file, a folder of them, or a list; fmt: "auto" | "alpaca" | "messages" | "text";
        # tokenizer: a transformers tokenizer or a local dir (AutoTokenizer, offline). eval is None when
        # neither eval_fraction nor eval_path is given. Raises ValueError on malformed lines (file:line).
    sampler = StepSampler(train, seq_len, micro_batch_size=8, grad_accum=1, packing=True, seed=0)
    sampler.steps_per_epoch                       # optimizer steps in one pass over the data
    sampler.tokens_for_step(step)                 # non-padding tokens of that step (for tokens/s)
    micro_batches = sampler.batches_for_step(step)  # [(input_ids, labels, position_ids)], LongTensor [B, T]
        # a pure function of (seed, step): a resumed job asks for step N and gets exactly what it got before.
    eval_micro_batches = eval_batches(eval, seq_len, micro_batch_size=8)   # fixed order, nothing dropped
    train.num_truncated, train.num_dropped      # examples cut to seq_len / left with no trained token

Preference pairs (objective dpo): ``load_pairs(path)`` -> ``tokenize_pairs(pairs, tok, seq_len)`` (rows 2i chosen,
2i+1 rejected, labelled on the completions) -> ``PairSampler(ds, micro_batch_size, grad_accum, seed)``.

Demo: ``build_demo_tokenizer(out_dir)`` writes a byte-level tokenizer (262 ids) with a chat template;
``make_demo_dataset(path, n, seed)`` writes checkable instruction data (messages JSONL);
``evaluate_demo(items, preds).accuracy`` scores a model's answers by exact match (items: ``make_demo_items(n, seed,
exclude=train_prompts)`` for a held-out set, or ``read_demo_items(path)``).

Every name below loads its module on first use (PEP 562), so that `horizon_ray.data.formats`, the JSONL rules
the API checks uploads with, imports neither torch nor numpy: the API's image has neither.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(("MicroBatch", "StepSampler", "eval_batches", "make_micro_batch", "pack_rows"), "batching"),
    **dict.fromkeys(("build_datasets", "split_examples"), "build"),
    **dict.fromkeys(("DEMO_TASKS", "DemoItem", "DemoScore", "evaluate_demo", "make_demo_dataset", "make_demo_items",
                     "make_demo_preferences", "read_demo_items", "score_answer"), "demo"),
    **dict.fromkeys(("FORMATS", "Example", "detect_format", "load_examples"), "formats"),
    **dict.fromkeys(("IGNORE_INDEX", "TokenizedDataset", "TokenizedExample", "load_tokenizer", "tokenize_example",
                     "tokenize_examples"), "tokenize"),
    "build_demo_tokenizer": "tokenizer",
    **dict.fromkeys(("PreferencePair", "load_pairs"), "preference"),
    **dict.fromkeys(("PairSampler", "pair_batches", "tokenize_pairs"), "pairs"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
