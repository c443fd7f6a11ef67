"""Job checkpoints: atomic on disk, so that a job killed at any instant resumes from a complete one.

Layout under ``<output_dir>/checkpoints/``::

    step-00000040/           engine/ (Engine.save_state), job_state.json, COMPLETE (written last)
    step-00000060.tmp-4242/  being written by pid 4242, or left behind by a killed run: never read

Writing (``horizon_ray.atomic``): everything goes into ``step-XXXXXXXX.tmp-<pid>``, every file and
directory is fsynced, the directory is renamed to ``step-XXXXXXXX`` (atomic within one filesystem), the
parent is fsynced, and only then is ``COMPLETE`` written and fsynced. A checkpoint without ``COMPLETE``
does not exist. Deleting goes the other way round: ``COMPLETE`` first, then the files.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizon_ray.atomic import Commit, atomic_path, fsync_dir, write_atomic

COMPLETE = "COMPLETE"
STATE_FILE = "job_state.json"
ENGINE_DIR = "engine"
_NAME = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class Checkpoint:
    step: int  # optimizer steps done when it was taken
    path: Path  # the step-XXXXXXXX directory

    @property
    def engine_dir(self) -> Path:
        return self.path / ENGINE_DIR

    def state(self) -> dict[str, Any]:
        return json.loads((self.path / STATE_FILE).read_text())


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def write_checkpoint(
    root: Path, step: int, save_engine: Callable[[Path], None], state: dict[str, Any], commit: Commit | None = None
) -> Checkpoint:
    """Write one checkpoint atomically. ``save_engine(dir)`` writes the engine state into ``dir``; `commit()` is
    held around each step that makes it visible (the rename, then COMPLETE): see ``atomic_path``."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    # An incomplete leftover of the same step (a run killed before COMPLETE) is not a checkpoint: replaced.
    assert not (final / COMPLETE).exists(), f"{final} is complete already"
    with atomic_path(final, commit) as tmp:
        tmp.mkdir()
        save_engine(tmp / ENGINE_DIR)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    write_atomic(final / COMPLETE, json.dumps({"step": step}).encode() + b"\n", commit)
    return Checkpoint(step, final)


def complete_checkpoints(root: Path) -> list[Checkpoint]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_dir() and (entry / COMPLETE).is_file():
            found.append(Checkpoint(int(m.group(1)), entry))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def remove_incomplete(root: Path) -> list[Path]:
    """Delete temporary directories and checkpoints without COMPLETE (leftovers of a killed run)."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        complete = _NAME.match(entry.name) and (entry / COMPLETE).is_file()
        if entry.name.startswith("step-") and not complete:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def prune(root: Path, keep: int) -> list[Checkpoint]:
    """Delete all but the newest ``keep`` complete checkpoints; COMPLETE goes first, so a delete that is
    interrupted leaves an incomplete checkpoint, never a damaged complete one."""
    assert keep >= 1, keep
    old = complete_checkpoints(root)[:-keep]
    for ckpt in old:
        (ckpt.path / COMPLETE).unlink()
        fsync_dir(ckpt.path)
        shutil.rmtree(ckpt.path)
    return old
