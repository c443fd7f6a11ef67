"""Packing, padding and the step sampler: boundaries, exact lengths, every token once, resumable order."""

import random

import pytest
import torch

from horizon_ray.data import (
    IGNORE_INDEX,
    StepSampler,
    TokenizedDataset,
    TokenizedExample,
    eval_batches,
    pack_rows,
)

PAD = 0
SEQ = 32


def _dataset(n=60, lo=3, hi=20, seed=0, seq_len=SEQ):
    """Example i holds tokens 1000*(i+1) + j, so every token says where it came from. Every label is set
    (first included), so the tests see batching itself mask each example's first token."""
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        ids = [1000 * (i + 1) + j for j in range(rng.randint(lo, hi))]
        examples.append(TokenizedExample(ids, list(ids), f"f:{i}"))
    return TokenizedDataset(examples, seq_len, PAD)


def _documents(ids_T, pos_T):
    """Split one row at position_ids == 0 into (start, end) pairs, padding excluded."""
    starts = [t for t in range(len(pos_T)) if pos_T[t] == 0]
    ends = starts[1:] + [len(pos_T)]
    docs = []
    for s, e in zip(starts, ends):
        real = [t for t in range(s, e) if ids_T[t] != PAD]
        docs.append((s, s + len(real)))
    return docs


def _check_row(ds, ids_T, labels_T, pos_T):
    ids_T, labels_T, pos_T = ids_T.tolist(), labels_T.tolist(), pos_T.tolist()
    assert pos_T[0] == 0, "a row starts with an example"
    seen = []
    docs = _documents(ids_T, pos_T)
    for s, e in docs:
        ex = ds.examples[ids_T[s] // 1000 - 1]
        assert ids_T[s:e] == list(ex.input_ids), "an example is contiguous, whole and starts at position 0"
        assert pos_T[s:e] == list(range(e - s))
        assert labels_T[s] == IGNORE_INDEX, "never trained to predict an example's first token"
        assert labels_T[s + 1 : e] == list(ex.labels[1:])
        seen.append(ex.source)
    end = docs[-1][1]
    assert all(t == PAD for t in ids_T[end:]) and all(t == IGNORE_INDEX for t in labels_T[end:])
    assert pos_T[end:] == list(range(pos_T[end - 1] + 1, pos_T[end - 1] + 1 + len(ids_T) - end))
    return seen


def test_pack_rows_plan_fits_and_uses_every_example_once():
    lengths = [5, 30, 7, 12, 32, 1, 20, 9]
    rows = pack_rows(lengths, 32)
    assert sorted(i for r in rows for i in r) == list(range(8))
    assert all(sum(lengths[i] for i in r) <= 32 for r in rows)
    # First fit in index order: 5+7+12+1 share row 0 (25), 30 alone, 32 alone, 20+9 share.
    assert rows == [[0, 2, 3, 5], [1], [4], [6, 7]]
    with pytest.raises(ValueError, match="more than seq_len=32"):
        pack_rows([33], 32)


def test_packed_epoch_has_exact_rows_boundaries_and_every_token_once():
    ds = _dataset()
    s = StepSampler(ds, SEQ, micro_batch_size=4, grad_accum=2, packing=True, seed=3, drop_last=False)
    seen = []
    for step in range(s.steps_per_epoch):
        mbs = s.batches_for_step(step)
        assert 1 <= len(mbs) <= 2
        for ids, labels, pos in mbs:
            assert ids.dtype == labels.dtype == pos.dtype == torch.long
            assert ids.shape == labels.shape == pos.shape and ids.shape[1] == SEQ
            for b in range(ids.shape[0]):
                seen += _check_row(ds, ids[b], labels[b], pos[b])
    assert sorted(seen) == sorted(e.source for e in ds.examples)
    assert s.num_rows < len(ds)  # it did pack
    assert s.steps_per_epoch == -(-s.num_rows // 8)


def test_shifted_labels_never_cross_a_document_boundary():
    # Engine convention: token t predicts labels[t + 1]; at each document's last token that must be ignored.
    ds = _dataset(n=40, lo=1, hi=6)
    s = StepSampler(ds, SEQ, micro_batch_size=4, packing=True)
    ((ids, labels, pos),) = s.batches_for_step(0)
    boundary = pos[:, 1:] == 0  # token t is the last of a document when t + 1 starts one
    assert boundary.sum() >= 12
    assert (labels[:, 1:][boundary] == IGNORE_INDEX).all()


def test_padding_mode_one_example_per_row_right_padded():
    ds = _dataset(n=10)
    s = StepSampler(ds, SEQ, micro_batch_size=5, packing=False, seed=0)
    assert s.num_rows == 10 and s.steps_per_epoch == 2
    for step in range(2):
        ((ids, labels, pos),) = s.batches_for_step(step)
        assert ids.shape == (5, SEQ)
        assert (pos == torch.arange(SEQ)).all(), "one document per row, positions count through the pad"
        for b in range(5):
            ex = ds.examples[int(ids[b, 0]) // 1000 - 1]
            n = len(ex.input_ids)
            assert ids[b, :n].tolist() == list(ex.input_ids)
            assert labels[b, :n].tolist() == [IGNORE_INDEX, *ex.labels[1:]]
            assert (ids[b, n:] == PAD).all() and (labels[b, n:] == IGNORE_INDEX).all()


@pytest.mark.parametrize("packing", [True, False])
def test_order_is_a_pure_function_of_seed_and_step(packing):
    ds = _dataset()
    a = StepSampler(ds, SEQ, micro_batch_size=2, grad_accum=2, packing=packing, seed=7)
    steps = [0, 1, a.steps_per_epoch - 1, a.steps_per_epoch, 3 * a.steps_per_epoch + 2]
    first = [a.batches_for_step(k) for k in steps]
    fresh = StepSampler(ds, SEQ, micro_batch_size=2, grad_accum=2, packing=packing, seed=7)
    for k, want in zip(reversed(steps), reversed(first)):  # another order of calls, a resumed job
        got = fresh.batches_for_step(k)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(g, w))
    again = a.batches_for_step(steps[1])
    assert all(torch.equal(x, y) for x, y in zip(again[0], first[1][0]))

    other = StepSampler(ds, SEQ, micro_batch_size=2, grad_accum=2, packing=packing, seed=8)
    assert not torch.equal(other.batches_for_step(0)[0][0], first[0][0][0])


def _epoch_rows(s, epoch):
    """The first-token id of every row of one epoch, in order."""
    out = []
    for k in range(epoch * s.steps_per_epoch, (epoch + 1) * s.steps_per_epoch):
        for ids, _, _ in s.batches_for_step(k):
            out += [tuple(r) for r in ids.tolist()]
    return out


def test_each_epoch_reorders_the_same_rows():
    s = StepSampler(_dataset(), SEQ, micro_batch_size=1, packing=True, seed=1, drop_last=False)
    e0, e1 = _epoch_rows(s, 0), _epoch_rows(s, 1)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert len(e0) == s.num_rows == s.steps_per_epoch
    assert s.epoch_of(s.steps_per_epoch) == 1 and s.total_steps(2.5) == -(-5 * s.steps_per_epoch // 2)


def test_drop_last_shapes_and_too_small_dataset():
    ds = _dataset(n=10)
    keep = StepSampler(ds, SEQ, micro_batch_size=3, grad_accum=2, packing=False, drop_last=False)
    drop = StepSampler(ds, SEQ, micro_batch_size=3, grad_accum=2, packing=False, drop_last=True)
    assert (keep.steps_per_epoch, drop.steps_per_epoch) == (2, 1)
    assert [m[0].shape[0] for m in keep.batches_for_step(1)] == [3, 1]  # 10 rows = 6 + 4
    assert [m[0].shape[0] for m in drop.batches_for_step(1)] == [3, 3]  # next epoch, full shape
    with pytest.raises(ValueError, match="one step needs micro_batch_size x grad_accum = 12"):
        StepSampler(ds, SEQ, micro_batch_size=4, grad_accum=3, packing=False)
    with pytest.raises(ValueError, match="seq_len=10 is shorter than the longest example"):
        StepSampler(ds, 10, packing=False)
    with pytest.raises(ValueError, match="no example"):
        StepSampler(TokenizedDataset([], SEQ, PAD), SEQ)
    with pytest.raises(ValueError, match="negative"):
        keep.batches_for_step(-1)


def test_tokens_for_step_counts_non_padding_tokens():
    ds = _dataset()
    s = StepSampler(ds, SEQ, micro_batch_size=4, grad_accum=2, packing=True, seed=0)
    for k in (0, 5, s.steps_per_epoch + 1):
        assert s.tokens_for_step(k) == sum(int((ids != PAD).sum()) for ids, _, _ in s.batches_for_step(k))


@pytest.mark.parametrize("packing", [True, False])
def test_eval_batches_cover_every_example_once_in_a_fixed_order(packing):
    ds = _dataset(n=23)
    batches = eval_batches(ds, SEQ, micro_batch_size=4, packing=packing)
    seen = []
    for ids, labels, pos in batches:
        for b in range(ids.shape[0]):
            seen += _check_row(ds, ids[b], labels[b], pos[b])
    assert sorted(seen) == sorted(e.source for e in ds.examples)
    if not packing:
        assert seen == [e.source for e in ds.examples]
        assert [m[0].shape[0] for m in batches] == [4, 4, 4, 4, 4, 3]
    assert all(
        torch.equal(x, y) for a, b in zip(batches, eval_batches(ds, SEQ, 4, packing)) for x, y in zip(a, b)
    )
