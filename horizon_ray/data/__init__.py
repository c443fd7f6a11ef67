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

Demo: ``build_demo_tokenizer(out_dir)`` writes a byte-level tokenizer (262 ids) with a chat template;
``make_demo_dataset(path, n, seed)`` writes checkable instruction data (messages JSONL);
``preds = greedy_answers(engine.forward_logits, tok, [it.prompt for it in items])`` then
``evaluate_demo(items, preds).accuracy`` scores exact matches (items: ``make_demo_items(n, seed,
exclude=train_prompts)`` for a held-out set, or ``read_demo_items(path)``).
"""

from horizon_ray.data.batching import MicroBatch, StepSampler, eval_batches, make_micro_batch, pack_rows
from horizon_ray.data.build import build_datasets, split_examples
from horizon_ray.data.demo import (
    DEMO_TASKS,
    DemoItem,
    DemoScore,
    evaluate_demo,
    greedy_answer,
    greedy_answers,
    make_demo_dataset,
    make_demo_items,
    read_demo_items,
    score_answer,
)
from horizon_ray.data.formats import FORMATS, Example, detect_format, load_examples
from horizon_ray.data.tokenize import (
    IGNORE_INDEX,
    TokenizedDataset,
    TokenizedExample,
    load_tokenizer,
    tokenize_example,
    tokenize_examples,
)
from horizon_ray.data.tokenizer import build_demo_tokenizer

__all__ = [
    "DEMO_TASKS",
    "FORMATS",
    "IGNORE_INDEX",
    "DemoItem",
    "DemoScore",
    "Example",
    "MicroBatch",
    "StepSampler",
    "TokenizedDataset",
    "TokenizedExample",
    "build_datasets",
    "build_demo_tokenizer",
    "detect_format",
    "eval_batches",
    "evaluate_demo",
    "greedy_answer",
    "greedy_answers",
    "load_examples",
    "load_tokenizer",
    "make_demo_dataset",
    "make_demo_items",
    "make_micro_batch",
    "pack_rows",
    "read_demo_items",
    "score_answer",
    "split_examples",
    "tokenize_example",
    "tokenize_examples",
]
