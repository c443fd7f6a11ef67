"""Files and directories that appear whole or not at all: a checkpoint, final/, job.yaml, DONE, a loss curve.

    with atomic_path(out / "final") as tmp:      # write a file or a directory at tmp
        eng.save_pretrained(tmp)
    write_atomic(out / "DONE", b"...")

The writer works on a temporary sibling, ``<name>.tmp-<pid>``, which is fsynced (every file, then every
directory bottom-up), renamed onto the target (atomic within one filesystem; a directory already there is
removed first) and whose parent is fsynced, so that the new name survives a crash. A run killed before the
rename leaves only the temporary, which never counts. Plain Python: the cluster uses it too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

Commit = Callable[[], AbstractContextManager]  # held around the rename that makes a write visible


@contextmanager
def atomic_path(path: str | os.PathLike, commit: Commit | None = None) -> Iterator[Path]:
    """A temporary sibling of `path` to write a file or a directory at; renamed onto `path` when the block
    ends without an error, removed when it raises. `commit()` is entered around the rename (a job's lease:
    a fenced engine makes nothing visible)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    _remove(tmp)  # this process's leftover of an earlier attempt
    try:
        yield tmp
        fsync_tree(tmp)
        with commit() if commit is not None else nullcontext():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        _remove(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes, commit: Commit | None = None) -> None:
    """`path` holds `data`, whole, or what it held before."""
    with atomic_path(path, commit) as tmp:
        tmp.write_bytes(data)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync a file, or every file under a directory, then every directory bottom-up (so that new names are
    durable)."""
    root = Path(root)
    if not root.is_dir():
        _fsync(root, os.O_RDONLY)
        return
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(root):
        dirs.append(dirpath)
        for name in filenames:
            _fsync(Path(dirpath) / name, os.O_RDONLY)
    for d in reversed(dirs):
        fsync_dir(Path(d))


def fsync_dir(path: str | os.PathLike) -> None:
    _fsync(Path(path), os.O_RDONLY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
