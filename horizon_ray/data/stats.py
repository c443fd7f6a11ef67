"""What a dataset holds, checked before any compute is spent on it.

- ``check_spec_data(spec)``: every line of the spec's data.path and data.eval_path read and checked, where this
  machine sees them (``horizon-ray submit``, ``finetune`` inside a Ray job): a malformed line is refused at
  submit with its ``file:line``, not on the node after the job was placed.
- ``dataset_stats(path, fmt, tokenizer)``: the examples of a JSONL file and, with a tokenizer, their tokens
  and a histogram of their lengths (the API shows it for each upload).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from horizon_ray.data.formats import detect_format, load_examples
from horizon_ray.errors import BadInput


@dataclass
class LengthBin:
    """Examples whose token count lies in [lo, hi)."""

    lo: int  # tokens, inclusive
    hi: int  # tokens, exclusive
    count: int  # examples in the bin


@dataclass
class DatasetStats:
    """One dataset file: its format, examples and, when a tokenizer was given, its tokens."""

    format: str  # alpaca | messages | text
    examples: int  # examples (non-blank lines)
    tokens: int | None = None  # tokens of every example as the tokenizer renders it (chat template included)
    trained_tokens: int | None = None  # of those, the tokens the loss trains (assistant turns, or all of a text)
    max_tokens: int | None = None  # the longest example
    mean_tokens: float | None = None  # tokens per example
    length_histogram: list[LengthBin] = field(default_factory=list)  # power-of-two bins of example lengths
    tokenizer: str | None = None  # the tokenizer counted with (its directory's name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dataset_stats(path: str | Path, fmt: str = "auto", tokenizer: Any = None) -> DatasetStats:
    """The examples of one JSONL file (BadInput naming ``file:line`` for a malformed one) and, with
    ``tokenizer`` (a transformers tokenizer or its directory), token counts and a histogram of lengths."""
    from horizon_ray.data.tokenize import IGNORE_INDEX, load_tokenizer, tokenize_example

    p = Path(path)
    examples = load_examples(p, fmt)
    stats = DatasetStats(format=detect_format(p) if fmt == "auto" else fmt, examples=len(examples))
    if tokenizer is None:
        return stats
    name = Path(tokenizer).name if isinstance(tokenizer, str | Path) else type(tokenizer).__name__
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    lengths, trained = [], 0
    for ex in examples:
        te = tokenize_example(ex, tok)
        lengths.append(len(te.input_ids))
        trained += sum(1 for t in te.labels if t != IGNORE_INDEX)
    stats.tokenizer = name
    stats.tokens, stats.trained_tokens = sum(lengths), trained
    stats.max_tokens = max(lengths)
    stats.mean_tokens = round(stats.tokens / len(lengths), 1)
    stats.length_histogram = length_histogram(lengths)
    return stats


def length_histogram(lengths: list[int]) -> list[LengthBin]:
    """Counts in power-of-two bins [0, 16), [16, 32), [32, 64) ... up to the longest; empty bins kept so that
    the shape reads at a glance."""
    if not lengths:
        return []
    edges = [0, 16]
    while edges[-1] <= max(lengths):
        edges.append(edges[-1] * 2)
    bins = [LengthBin(lo, hi, 0) for lo, hi in zip(edges[:-1], edges[1:])]
    for n in lengths:
        i = next(i for i, b in enumerate(bins) if n < b.hi)
        bins[i].count += 1
    return bins


def check_spec_data(spec: Any) -> dict[str, int]:
    """Read and check every line of ``spec.data.path`` and ``spec.data.eval_path`` where this machine sees them
    (a path it does not see is left to the node that runs the job). Returns {field: examples} of what it
    checked; BadInput naming the field, the file and line, and the fix otherwise."""
    checked = {}
    for key, value in (("data.path", spec.data.path), ("data.eval_path", spec.data.eval_path)):
        if not value or not Path(value).expanduser().exists():
            continue
        try:
            checked[key] = len(load_examples(Path(value).expanduser(), spec.data.format))
        except UnicodeDecodeError:
            raise BadInput(f"{key} {value}: not UTF-8 text; give a UTF-8 JSONL file", field=key) from None
        except BadInput as exc:
            raise BadInput(f"{key}: {exc.message}", field=key) from None
    return checked
