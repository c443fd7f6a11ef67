"""Preference pairs as token ids, and the micro-batches of a preference job's steps.

A tokenized pair is two rows that share the prompt's tokens: chosen at example 2i, rejected at 2i+1 of a
``TokenizedDataset``, labelled on their completion only (the engine sums each row's log-probabilities over
its labels). Plain text: the prompt with the tokenizer's special tokens, each completion after it with eos
appended. Chat: the prompt's turns rendered with the generation prompt, and the prompt's turns + a
completion's rendered whole; the completion's tokens are those past the prompt's (the template must render the
prompt as a prefix of the whole, as SFT's masks need).

Truncation keeps the prompt's end and the completion's start: a pair whose longer row exceeds seq_len keeps
the last max(seq_len // 2, seq_len - longer completion) tokens of its prompt and cuts both completions to the
room left; it is counted in ``num_truncated``.

``PairSampler`` gives step N's micro-batches as a pure function of (seed, N), like ``StepSampler``: each holds
micro_batch_size rows, micro_batch_size / 2 whole pairs, rows 2i and 2i+1 (as ``Engine.train_step(...,
dpo=...)`` takes them), and ``rows_for_step(N)`` says which dataset rows they are (the reference's index).
"""

from __future__ import annotations

import hashlib
import logging
import math
from array import array

import numpy as np

from horizon_ray.data.batching import MicroBatch, make_micro_batch
from horizon_ray.data.preference import PreferencePair
from horizon_ray.data.shuffle import EPOCH_STREAM, permutation
from horizon_ray.data.tokenize import IGNORE_INDEX, TokenizedDataset, TokenizedExample, _ids, _render
from horizon_ray.errors import BadInput

log = logging.getLogger(__name__)


def _prompt_ids(pair: PreferencePair, tokenizer) -> list[int]:
    if isinstance(pair.prompt, str):  # not pair.chat
        return _ids(tokenizer(pair.prompt, add_special_tokens=True))
    return _ids(tokenizer(_render(tokenizer, pair.prompt, add_generation_prompt=True), add_special_tokens=False))


def _completion_ids(pair: PreferencePair, completion, prompt_ids: list[int], tokenizer) -> list[int]:
    if not pair.chat:
        ids = _ids(tokenizer(completion, add_special_tokens=False))
        eos = tokenizer.eos_token_id
        return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids
    # the template's own whitespace after the last end-of-turn token is no part of the completion
    whole = _ids(tokenizer(_render(tokenizer, pair.prompt + completion).rstrip(), add_special_tokens=False))
    if whole[:len(prompt_ids)] != prompt_ids:
        raise BadInput(f"{pair.source}: the chat template renders the prompt differently once the completion "
                       "follows, so the completion's tokens cannot be told apart; use a template whose rendering "
                       "of the prompt (with the generation prompt) is a prefix of the whole conversation")
    return whole[len(prompt_ids):]


def row_lengths(pair: PreferencePair, tokenizer) -> tuple[int, list[int]]:
    """Tokens of the pair's prompt and of each completion, untruncated."""
    prompt = _prompt_ids(pair, tokenizer)
    return len(prompt), [len(_completion_ids(pair, c, prompt, tokenizer)) for c in (pair.chosen, pair.rejected)]


def tokenize_pairs(pairs: list[PreferencePair], tokenizer, seq_len: int) -> TokenizedDataset:
    """Rows 2i (chosen) and 2i+1 (rejected) of every pair, at most seq_len tokens each; refuses a pair with an
    empty completion and a template that cannot tell the completion apart."""
    if not getattr(tokenizer, "chat_template", None) and any(p.chat for p in pairs):
        raise BadInput(f"{pairs[0].source}: the tokenizer has no chat_template, which message-list pairs need; use "
                       "the model's instruct tokenizer or give the pairs as plain strings")
    if seq_len < 4:
        raise BadInput(f"seq_len={seq_len} is too short for a prompt and a completion; use at least 4 (typically "
                       "1024+)")
    rows: list[TokenizedExample] = []
    truncated = 0
    for pair in pairs:
        prompt = _prompt_ids(pair, tokenizer)
        done = [_completion_ids(pair, c, prompt, tokenizer) for c in (pair.chosen, pair.rejected)]
        for which, c in zip(("chosen", "rejected"), done):
            if not c:
                raise BadInput(f"{pair.source}: the {which} completion has no token; give it text")
        longest = max(len(c) for c in done)
        if len(prompt) + longest > seq_len:
            truncated += 1
            keep = min(len(prompt), max(seq_len // 2, seq_len - longest))
            prompt = prompt[len(prompt) - keep:]
            done = [c[:seq_len - keep] for c in done]
        for c in done:
            labels = [IGNORE_INDEX] * len(prompt) + c
            labels[0] = IGNORE_INDEX  # nothing precedes the first token (a prompt-less pair's first token)
            rows.append(TokenizedExample(array("i", prompt + c), array("i", labels), pair.source))
    if truncated:
        log.warning("%d of %d preference pairs longer than seq_len=%d were truncated (the prompt's end and the "
                    "completions' start kept)", truncated, len(pairs), seq_len)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return TokenizedDataset(rows, seq_len, int(pad), truncated, 0)


def data_hash(dataset: TokenizedDataset) -> str:
    """A digest of every row's tokens and labels, in order: what a reference's log-probs were computed on."""
    h = hashlib.sha256(f"{dataset.seq_len}:{len(dataset.examples)}".encode())
    for ex in dataset.examples:
        h.update(len(ex.input_ids).to_bytes(4, "little"))
        h.update(ex.input_ids.tobytes())
        h.update(ex.labels.tobytes())
    return h.hexdigest()


def pair_batches(dataset: TokenizedDataset, rows: list[int], micro_batch_size: int) -> list[MicroBatch]:
    """Micro-batches of ``rows`` (dataset rows, pairs adjacent) of micro_batch_size rows each, right-padded to the
    longest row of each (a pair's completion ends where its row does: no padding in between)."""
    out = []
    for j in range(0, len(rows), micro_batch_size):
        part = rows[j:j + micro_batch_size]
        T = max(len(dataset.examples[r]) for r in part)
        out.append(make_micro_batch(dataset.examples, [[r] for r in part], T, dataset.pad_id))
    return out


class PairSampler:
    """The micro-batches of every step of a preference job, as a pure function of (seed, step): ``grad_accum``
    micro-batches of ``micro_batch_size`` rows (``micro_batch_size / 2`` pairs); an epoch visits the pairs in a
    permutation keyed by (seed, epoch), the pairs that do not fill a step skipped in that epoch."""

    def __init__(self, dataset: TokenizedDataset, micro_batch_size: int, grad_accum: int = 1, seed: int = 0):
        if micro_batch_size < 2 or micro_batch_size % 2:
            raise BadInput(f"micro_batch_size={micro_batch_size} counts rows, two a pair: give an even number >= 2",
                           field="training.micro_batch_size")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.num_pairs = len(dataset.examples) // 2
        self.pairs_per_step = micro_batch_size // 2 * grad_accum
        self.steps_per_epoch = self.num_pairs // self.pairs_per_step
        if self.steps_per_epoch == 0:
            raise BadInput(f"the dataset holds {self.num_pairs} pairs but one step needs micro_batch_size / 2 x "
                           f"grad_accum = {self.pairs_per_step}; lower them or add pairs")
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def total_steps(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.steps_per_epoch))

    def rows_for_step(self, step: int) -> list[int]:
        """The dataset rows of step ``step`` in their order in its micro-batches (chosen, rejected, ...)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, permutation(self.num_pairs, self.seed, EPOCH_STREAM, epoch))
        picked = self._epoch_cache[1][k * self.pairs_per_step:(k + 1) * self.pairs_per_step]
        return [r for p in picked.tolist() for r in (2 * p, 2 * p + 1)]

    def batches_for_step(self, step: int) -> list[MicroBatch]:
        return pair_batches(self.dataset, self.rows_for_step(step), self.micro_batch_size)

    def tokens_for_step(self, step: int) -> int:
        """Non-padding tokens of the step: chosen + rejected rows, prompts included."""
        return sum(len(self.dataset.examples[r]) for r in self.rows_for_step(step))
