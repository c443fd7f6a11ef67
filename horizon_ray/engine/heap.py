"""The C heap's free memory: given back to the OS after a load, and counted for the bench.

Host RAM is what bounds a job, so memory a load freed must leave the process, not stay resident in malloc's
free lists. glibc keeps freed chunks below its mmap threshold (which rises to the size of the largest block
freed, up to 32 MiB) in the arena that served them, one arena per thread that allocated. A load's temporaries
of a few MiB each (bitsandbytes' CPU quantization chunks, a checkpoint's per-expert tensors) then stay resident
after the load. ``give_back`` asks glibc to return every free page (``malloc_trim(0)``); ``free_bytes`` says
how many bytes its arenas hold free (``mallinfo2``). Both do nothing, and say None, where the C library is not
glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc():
    """glibc with malloc_trim and mallinfo2 (2.33 and later), or None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallinfo2"):
            return None
    except OSError:
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def give_back() -> None:
    """Return the free pages of every malloc arena to the OS."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def free_bytes() -> int | None:
    """Bytes free inside malloc's arenas (resident or not), or None where that cannot be read."""
    libc = _libc()
    return None if libc is None else int(libc.mallinfo2().fordblks)
