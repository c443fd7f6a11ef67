"""Deterministic permutations that depend only on integer keys (seed, epoch, purpose).

Sorting by a splitmix64 hash of (keys, index) instead of calling a library RNG: the result is the same on
every numpy and Python version, so a job resumed on another node (or after an upgrade) sees exactly the
data order it would have seen without the interruption.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1

# Purposes, mixed into the keys so that the eval split, the packing order and the epoch orders are
# independent streams even for the same seed.
SPLIT_STREAM = 1
PACK_STREAM = 2
EPOCH_STREAM = 3


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def permutation(n: int, *keys: int) -> np.ndarray:
    """A permutation of range(n) (int64 array) that is a pure function of (n, keys)."""
    state = 0
    for k in keys:
        state = _splitmix64(state ^ (k & _MASK))
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(state)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    # Stable sort: ties (astronomically rare) resolve by index, still deterministic.
    return np.argsort(z, kind="stable").astype(np.int64)
