"""A directory of a job's outputs as one streamed tar (``GET /finetune/{id}/outputs/final.tar``).

The archive is written as it is sent, a file at a time in 1 MiB reads, so a model of any size downloads in
one request without this process holding more than a chunk; its length is known before the first byte (the
Content-Length of the response). Only regular files and directories inside the directory go in: a symbolic
link is never followed out of it, and a file with a second name (a hard link) is left out.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
BLOCK = 512


@dataclass(frozen=True)
class _Member:
    header: bytes  # the member's tar header (PAX)
    path: Path | None  # the file to send after it; None for a directory
    size: int  # bytes of the file


def _members(root: Path, arcroot: str) -> list[_Member]:
    out = [_Member(_header(arcroot, tarfile.DIRTYPE, 0, root.stat().st_mtime), None, 0)]
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(dirnames):
            st = os.lstat(base / name)
            if stat.S_ISDIR(st.st_mode):
                rel = (base / name).relative_to(root).as_posix()
                out.append(_Member(_header(f"{arcroot}/{rel}", tarfile.DIRTYPE, 0, st.st_mtime), None, 0))
        for name in sorted(filenames):
            st = os.lstat(base / name)
            # a link, a hard link (another file's second name) or anything but a file is not an output
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                continue
            rel = (base / name).relative_to(root).as_posix()
            out.append(_Member(_header(f"{arcroot}/{rel}", tarfile.REGTYPE, st.st_size, st.st_mtime),
                               base / name, st.st_size))
    return out


def _header(name: str, kind: bytes, size: int, mtime: float) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mtime = kind, size, int(mtime)
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT)


def _padding(size: int) -> int:
    return -size % BLOCK


class TarStream:
    """`directory` as a tar whose members are `arcroot/...`: `length` bytes, produced by iterating."""

    def __init__(self, directory: Path, arcroot: str):
        self.members = _members(directory, arcroot)
        self.length = sum(len(m.header) + m.size + _padding(m.size) for m in self.members) + 2 * BLOCK

    def __iter__(self) -> Iterator[bytes]:
        for m in self.members:
            yield m.header
            if m.path is None:
                continue
            sent = 0
            # never through a link: a file replaced by one since it was listed is not followed out of the directory
            with os.fdopen(os.open(m.path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                while sent < m.size:
                    chunk = f.read(min(CHUNK, m.size - sent))
                    if not chunk:  # the file shrank since it was listed: its member stays the declared size
                        raise OSError(f"{m.path} changed while it was being sent")
                    sent += len(chunk)
                    yield chunk
            if _padding(m.size):
                yield b"\0" * _padding(m.size)
        yield b"\0" * (2 * BLOCK)  # the end-of-archive marker
