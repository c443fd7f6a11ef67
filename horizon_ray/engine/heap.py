"""The C heap's free memory: given back to the OS after a load, and counted for the bench.

Host RAM is what bounds a job, so memory a load freed must leave the process, not stay resident in malloc's
free lists. glibc serves a block from the heap unless it is above its mmap threshold, which rises to the size
of the largest mmapped block freed so far (up to 32 MiB), and keeps freed heap blocks in the arena that served
them (an arena per thread, up to 8 a core, then shared). A load's temporaries of a few MiB each
(bitsandbytes' CPU quantization chunks, a checkpoint's per-expert tensors) would then stay resident after the
load. ``give_back`` asks glibc to return every whole free page (``malloc_trim(0)``); ``free_bytes`` says how
many bytes its free lists hold (``mallinfo2``; resident or not: a page given back stays on the list). Each
does nothing and says None where the C library lacks its function (not glibc; mallinfo2 since glibc 2.33).
"""

from __future__ import annotations

import ctypes
import functools


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc(function: str):
    """``function`` of the C library this process runs on, or None where it has none."""
    try:
        f = getattr(ctypes.CDLL(None), function)
    except (OSError, AttributeError):
        return None
    if function == "mallinfo2":
        f.restype = _MallInfo2
    else:
        f.argtypes = [ctypes.c_size_t]
    return f


def give_back() -> None:
    """Return the free pages of every malloc arena to the OS."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


def free_bytes() -> int | None:
    """Bytes on malloc's free lists (resident or not), or None where that cannot be read."""
    info = _libc("mallinfo2")
    return None if info is None else int(info().fordblks)
