"""Rows of exactly seq_len tokens, micro-batches, and the step sampler.

A micro-batch is ``(input_ids, labels, position_ids)``, LongTensor [B, T] with T = seq_len, as
``Engine.train_step`` takes it.

- Packed rows hold several examples back to back. ``position_ids`` restart at 0 at every example, which
  is how the engine finds document boundaries and blocks attention across them; the first token of a
  row is always an example start. ``labels`` at each example's first token is IGNORE_INDEX: the engine
  shifts (token t predicts labels[t + 1]), so otherwise the previous example's last token would be
  trained to predict the next example's first token.
- Unpacked rows hold one example each.
- Either way the rest of the row is padding: pad id, label IGNORE_INDEX, and position_ids that keep
  counting from the last example (the padding never starts a document of its own).

Rows are planned once (packing is first-fit in an order shuffled by the seed), and each epoch visits
them in a permutation keyed by (seed, epoch). ``batches_for_step(step)`` therefore depends only on the
dataset, the sampler's arguments and ``step``: a resumed job needs no sampler state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from horizon_ray.data.shuffle import EPOCH_STREAM, PACK_STREAM, permutation
from horizon_ray.data.tokenize import IGNORE_INDEX, TokenizedDataset, TokenizedExample
from horizon_ray.errors import BadInput

MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# First-fit looks for room among this many open rows; bounding it keeps packing linear in the number of
# examples (a row that found no taker among the last 64 is closed), at a negligible cost in fill.
MAX_OPEN_ROWS = 64


def pack_rows(lengths: Sequence[int], seq_len: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """First-fit packing plan: lists of example indices whose lengths sum to at most ``seq_len``.

    Examples are placed in ``order`` (default: index order) into the first open row with room.
    """
    if order is None:
        order = range(len(lengths))
    rows: list[list[int]] = []
    room: list[int] = []  # free tokens per row
    open_rows: list[int] = []  # indices into rows, oldest first
    for i in order:
        n = lengths[i]
        if n > seq_len:
            raise BadInput(
                f"example {i} has {n} tokens, more than seq_len={seq_len}; tokenize with the same seq_len "
                "the sampler uses"
            )
        target = next((r for r in open_rows if room[r] >= n), None)
        if target is None:
            target = len(rows)
            rows.append([])
            room.append(seq_len)
            open_rows.append(target)
            if len(open_rows) > MAX_OPEN_ROWS:
                open_rows.pop(0)
        rows[target].append(int(i))
        room[target] -= n
        if room[target] == 0:
            open_rows.remove(target)
    return rows


def make_micro_batch(
    examples: Sequence[TokenizedExample], rows: Sequence[Sequence[int]], seq_len: int, pad_id: int
) -> MicroBatch:
    """Tensors for ``rows`` (each a list of indices into ``examples``), right-padded to ``seq_len``."""
    # Assembled in numpy (cheap slice writes), handed to torch once without a copy.
    ids_BT = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels_BT = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    pos_BT = np.empty((len(rows), seq_len), dtype=np.int64)
    for b, row in enumerate(rows):
        t = 0
        start = 0
        for i in row:
            ex = examples[i]
            n = len(ex.input_ids)
            assert t + n <= seq_len, "row overflows seq_len"
            ids_BT[b, t : t + n] = np.frombuffer(ex.input_ids, dtype=np.int32)
            labels_BT[b, t : t + n] = np.frombuffer(ex.labels, dtype=np.int32)
            # Never trained to predict an example's first token from the one before it (another example).
            labels_BT[b, t] = IGNORE_INDEX
            pos_BT[b, t : t + n] = np.arange(n)
            start = t
            t += n
        # Padding continues the last example's positions, so it never opens a document of its own.
        pos_BT[b, t:] = np.arange(t - start, seq_len - start)
    return torch.from_numpy(ids_BT), torch.from_numpy(labels_BT), torch.from_numpy(pos_BT)


def _check_args(dataset: TokenizedDataset, seq_len: int, micro_batch_size: int) -> None:
    if micro_batch_size < 1:
        raise BadInput(f"micro_batch_size={micro_batch_size} must be at least 1")
    if not dataset.examples:
        raise BadInput("the dataset has no example; build it with build_datasets, which refuses empty data")
    longest = max(len(e) for e in dataset.examples)
    if seq_len < longest:
        raise BadInput(
            f"seq_len={seq_len} is shorter than the longest example ({longest} tokens, the dataset was "
            f"truncated to {dataset.seq_len}); use the seq_len the dataset was built with"
        )


def _plan(
    dataset: TokenizedDataset, seq_len: int, packing: bool, order: Sequence[int] | None
) -> list[list[int]]:
    if not packing:
        return [[int(i)] for i in (order if order is not None else range(len(dataset.examples)))]
    return pack_rows([len(e) for e in dataset.examples], seq_len, order)


class StepSampler:
    """The micro-batches of every optimizer step, as a pure function of (seed, global_step).

    One step is ``grad_accum`` micro-batches of ``micro_batch_size`` rows. ``epoch = step //
    steps_per_epoch``; steps past the first epoch wrap around with a new row order. With ``drop_last``
    (default) every step has the same shape and the rows that do not fill a step are skipped in that epoch
    (other rows are skipped in the next, since the order changes); without it the last step of an epoch
    has fewer rows: fewer micro-batches and/or a smaller last one.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        seq_len: int,
        micro_batch_size: int = 1,
        grad_accum: int = 1,
        packing: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        _check_args(dataset, seq_len, micro_batch_size)
        if grad_accum < 1:
            raise BadInput(f"grad_accum={grad_accum} must be at least 1")
        self.dataset = dataset
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.packing = packing
        self.seed = seed
        self.drop_last = drop_last
        n = len(dataset.examples)
        # Packing order is shuffled once by the seed so that rows mix examples from all over the file.
        self.rows = _plan(dataset, seq_len, packing, permutation(n, seed, PACK_STREAM).tolist())
        self.rows_per_step = micro_batch_size * grad_accum
        full, rest = divmod(len(self.rows), self.rows_per_step)
        self._steps_per_epoch = full if drop_last else full + (rest > 0)
        if self._steps_per_epoch == 0:
            raise BadInput(
                f"the dataset fills {len(self.rows)} rows of seq_len={seq_len} but one step needs "
                f"micro_batch_size x grad_accum = {self.rows_per_step}; lower them, add data, or set "
                "drop_last=False"
            )
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    @property
    def num_rows(self) -> int:
        """Rows of seq_len tokens in one epoch."""
        return len(self.rows)

    def epoch_of(self, global_step: int) -> int:
        return global_step // self._steps_per_epoch

    def total_steps(self, epochs: float) -> int:
        """Steps for ``epochs`` passes over the data (rounded up)."""
        return max(1, math.ceil(epochs * self._steps_per_epoch))

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, permutation(len(self.rows), self.seed, EPOCH_STREAM, epoch))
        return self._epoch_cache[1]

    def _rows_for_step(self, global_step: int) -> list[list[int]]:
        if global_step < 0:
            raise BadInput(f"global_step={global_step} is negative; steps count from 0")
        epoch, k = divmod(global_step, self._steps_per_epoch)
        picked = self._epoch_order(epoch)[k * self.rows_per_step : (k + 1) * self.rows_per_step]
        return [self.rows[int(r)] for r in picked]

    def batches_for_step(self, global_step: int) -> list[MicroBatch]:
        """The micro-batches of optimizer step ``global_step`` (0-based, counted over all epochs)."""
        rows = self._rows_for_step(global_step)
        mbs = self.micro_batch_size
        return [
            make_micro_batch(self.dataset.examples, rows[j : j + mbs], self.seq_len, self.dataset.pad_id)
            for j in range(0, len(rows), mbs)
        ]

    def tokens_for_step(self, global_step: int) -> int:
        """Non-padding tokens in step ``global_step`` (for tokens/s, which counts no padding)."""
        examples = self.dataset.examples
        return sum(len(examples[i]) for row in self._rows_for_step(global_step) for i in row)


def eval_batches(
    dataset: TokenizedDataset, seq_len: int, micro_batch_size: int = 1, packing: bool = True
) -> list[MicroBatch]:
    """Every eval example exactly once, nothing dropped, in a fixed order (no shuffle; packed first-fit in
    file order); the last micro-batch may be smaller."""
    _check_args(dataset, seq_len, micro_batch_size)
    rows = _plan(dataset, seq_len, packing, None)
    return [
        make_micro_batch(dataset.examples, rows[j : j + micro_batch_size], seq_len, dataset.pad_id)
        for j in range(0, len(rows), micro_batch_size)
    ]
