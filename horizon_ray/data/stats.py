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

from horizon_ray.data.formats import detect_format, iter_file, layout_of, load_examples
from horizon_ray.data.preference import FORMAT as PREFERENCE
from horizon_ray.data.preference import load_pairs
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
    # preference pairs (examples counts pairs, tokens both rows of each): seq_len -> pairs whose longer row does not
    # fit it, which a job of that seq_len truncates (the prompt's end and the completions' start kept)
    truncated_pairs: dict[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dataset_stats(path: str | Path, fmt: str = "auto", tokenizer: Any = None) -> DatasetStats:
    """The examples of one JSONL file (BadInput naming ``file:line`` for a malformed one) and, with
    ``tokenizer`` (a transformers tokenizer or its directory), token counts and a histogram of lengths. The
    file is read an example at a time: memory holds one line and the histogram's counts, whatever its size."""
    p = Path(path)
    file_fmt = detect_format(p) if fmt == "auto" else fmt
    tok, name = None, None
    if tokenizer is not None:
        from horizon_ray.data.tokenize import IGNORE_INDEX, load_tokenizer, tokenize_example

        name = Path(tokenizer).name if isinstance(tokenizer, str | Path) else type(tokenizer).__name__
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    if file_fmt == PREFERENCE:
        return _preference_stats(p, tok, name)
    count, tokens, trained, longest = 0, 0, 0, 0
    hist = _Histogram()
    for ex in iter_file(p, file_fmt):
        count += 1
        if tok is None:
            continue
        te = tokenize_example(ex, tok)
        n = len(te.input_ids)
        tokens, longest = tokens + n, max(longest, n)
        trained += sum(1 for t in te.labels if t != IGNORE_INDEX)
        hist.add(n)
    if not count:
        raise BadInput(f"dataset {p} holds no example; add JSONL lines in alpaca, messages or text format")
    stats = DatasetStats(format=file_fmt, examples=count)
    if tok is None:
        return stats
    stats.tokenizer = name
    stats.tokens, stats.trained_tokens, stats.max_tokens = tokens, trained, longest
    stats.mean_tokens = round(tokens / count, 1)
    stats.length_histogram = hist.bins()
    return stats


# the sequence lengths an upload's statistics count truncated pairs at
TRUNCATION_SEQ_LENS = (512, 1024, 2048, 4096, 8192)


def _preference_stats(path: Path, tok: Any, name: str | None) -> DatasetStats:
    """A preference file's pairs and, with a tokenizer, the tokens of both rows of each and the pairs each common
    seq_len would truncate."""
    pairs = load_pairs(path, PREFERENCE)
    stats = DatasetStats(format=PREFERENCE, examples=len(pairs))
    if tok is None:
        return stats
    from horizon_ray.data.pairs import row_lengths

    hist, tokens, trained, longest = _Histogram(), 0, 0, 0
    truncated = dict.fromkeys(TRUNCATION_SEQ_LENS, 0)
    for pair in pairs:
        prompt, completions = row_lengths(pair, tok)
        for c in completions:
            hist.add(prompt + c)
            tokens, trained = tokens + prompt + c, trained + c
        longer = prompt + max(completions)
        longest = max(longest, longer)
        for n in TRUNCATION_SEQ_LENS:
            truncated[n] += longer > n
    stats.tokenizer, stats.tokens, stats.trained_tokens, stats.max_tokens = name, tokens, trained, longest
    stats.mean_tokens = round(tokens / (2 * len(pairs)), 1)
    stats.length_histogram = hist.bins()
    stats.truncated_pairs = truncated
    return stats


class _Histogram:
    """Example lengths counted in the bins of ``length_histogram``, one length at a time."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # bin index -> examples

    def add(self, n: int) -> None:
        i = 0 if n < 16 else n.bit_length() - 4  # [0, 16) is bin 0, [16, 32) bin 1, [32, 64) bin 2, ...
        self.counts[i] = self.counts.get(i, 0) + 1

    def bins(self) -> list[LengthBin]:
        if not self.counts:
            return []
        edges = [0] + [16 << i for i in range(max(self.counts) + 1)]
        return [LengthBin(lo, hi, self.counts.get(i, 0)) for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))]


def length_histogram(lengths: list[int]) -> list[LengthBin]:
    """Counts in power-of-two bins [0, 16), [16, 32), [32, 64) ... up to the longest; empty bins kept so that
    the shape reads at a glance."""
    hist = _Histogram()
    for n in lengths:
        hist.add(n)
    return hist.bins()


def check_spec_data(spec: Any) -> dict[str, int]:
    """Read and check every line of ``spec.data.path`` and ``spec.data.eval_path`` where this machine sees them
    (a path it does not see is left to the node that runs the job). Returns {field: examples} of what it
    checked; BadInput naming the field, the file and line, and the fix otherwise."""
    checked = {}
    for key, value in (("data.path", spec.data.path), ("data.eval_path", spec.data.eval_path)):
        if not value or not Path(value).expanduser().exists():
            continue
        try:
            if getattr(spec, "objective", "sft") == "dpo":
                checked[key] = len(load_pairs(Path(value).expanduser(), spec.data.format))
            else:
                checked[key] = len(load_examples(Path(value).expanduser(), spec.data.format, layout_of(spec.data)))
        except UnicodeDecodeError:
            raise BadInput(f"{key} {value}: not UTF-8 text; give a UTF-8 JSONL file", field=key) from None
        except BadInput as exc:
            raise BadInput(f"{key}: {exc.message}", field=key) from None
    return checked
