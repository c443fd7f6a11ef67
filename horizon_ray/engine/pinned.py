"""Page-locked host buffers of exactly the size asked for.

torch's pinned allocator (``pin_memory=True``) rounds every buffer up to a power of two: for a 7B model's
store that is gigabytes of RAM that hold nothing. Large buffers here are ordinary allocations registered
with cudaHostRegister instead; they are unregistered before their memory can be freed (when the owner
closes or is collected). Small ones, where rounding costs nothing, use torch's allocator.
"""

from __future__ import annotations

import weakref

import torch

_REGISTER_MIN_BYTES = 1 << 20


class PinnedPool:
    def __init__(self, enabled: bool, shared: bool = False):
        self.enabled = enabled
        self.shared = shared  # buffers in shared memory, for the ranks of a job to map (ranks.py)
        self._registered: list[int] = []  # data pointers this pool registered
        self._finalizer = weakref.finalize(self, _unregister_all, self._registered)

    def empty(self, shape, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        if self.shared:
            return make(shape, dtype=dtype).share_memory_()
        if not self.enabled:
            return make(shape, dtype=dtype)
        probe = torch.empty(0, dtype=dtype)
        nbytes = probe.element_size() * _numel(shape)
        if nbytes < _REGISTER_MIN_BYTES:
            return make(shape, dtype=dtype, pin_memory=True)
        return self.register(make(shape, dtype=dtype))

    def register(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock an existing buffer (a rank pins the shared store in its own CUDA context)."""
        if not self.enabled or t.nbytes == 0 or t.data_ptr() in self._registered:
            return t
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
        if int(getattr(rc, "value", rc)) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.nbytes} bytes failed with CUDA error {rc}; "
                               "the node may lack lockable memory (ulimit -l)")
        self._registered.append(t.data_ptr())
        return t

    def free(self, t: torch.Tensor) -> None:
        """Unregister a buffer this pool made, before the caller drops it."""
        if t.data_ptr() in self._registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            self._registered.remove(t.data_ptr())

    def close(self) -> None:
        self._finalizer()


def _numel(shape) -> int:
    if isinstance(shape, int):
        return shape
    n = 1
    for s in shape:
        n *= s
    return n


def _unregister_all(pointers: list[int]) -> None:
    for ptr in pointers:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    pointers.clear()


class HostBuffers:
    """Pinned host buffers reused step after step under a key (pinning costs far more than the copy)."""

    def __init__(self, pool: PinnedPool):
        self.pool = pool
        self._bufs: dict = {}

    def get(self, key, shape, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
            if buf is not None:
                self.pool.free(buf)
            buf = self.pool.empty(tuple(shape), dtype)
            self._bufs[key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())
