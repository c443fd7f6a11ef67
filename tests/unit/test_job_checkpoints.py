"""Job checkpoints are atomic: one cut off mid-write (the process SIGKILLed) never counts, and resume
cleans it up; pruning keeps the newest `keep` and never leaves a damaged complete one."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from horizon_ray.job import checkpoints as ck

ROOT = Path(__file__).resolve().parents[2]


def _saver(payload: bytes):
    def save(d: Path) -> None:
        d.mkdir(parents=True)
        (d / "engine_state.safetensors").write_bytes(payload)

    return save


def test_a_written_checkpoint_is_complete_and_readable(tmp_path):
    c = ck.write_checkpoint(tmp_path, 40, _saver(b"weights"), {"step": 40, "training_hash": "h"})
    assert c.path.name == "step-00000040"
    assert (c.path / ck.COMPLETE).is_file()
    assert (c.engine_dir / "engine_state.safetensors").read_bytes() == b"weights"
    assert c.state() == {"step": 40, "training_hash": "h"}
    assert ck.latest_checkpoint(tmp_path) == c
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_incomplete_checkpoints_do_not_count_and_are_removed(tmp_path):
    good = ck.write_checkpoint(tmp_path, 10, _saver(b"a"), {"step": 10})
    # A newer one renamed into place but killed before its COMPLETE marker, and a temporary directory.
    (tmp_path / "step-00000020" / "engine").mkdir(parents=True)
    (tmp_path / "step-00000030.tmp-999" / "engine").mkdir(parents=True)
    assert ck.latest_checkpoint(tmp_path) == good
    removed = ck.remove_incomplete(tmp_path)
    assert sorted(p.name for p in removed) == ["step-00000020", "step-00000030.tmp-999"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000010"]


def test_rewriting_a_step_over_an_incomplete_leftover(tmp_path):
    (tmp_path / "step-00000020" / "engine").mkdir(parents=True)
    c = ck.write_checkpoint(tmp_path, 20, _saver(b"new"), {"step": 20})
    assert (c.engine_dir / "engine_state.safetensors").read_bytes() == b"new"


def test_prune_keeps_the_newest(tmp_path):
    for step in (10, 20, 30, 40):
        ck.write_checkpoint(tmp_path, step, _saver(b"x"), {"step": step})
    gone = ck.prune(tmp_path, keep=2)
    assert [c.step for c in gone] == [10, 20]
    assert [c.step for c in ck.complete_checkpoints(tmp_path)] == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]


_KILL_MID_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from horizon_ray.job import checkpoints as ck

    root = Path(sys.argv[1])
    ck.write_checkpoint(root, 10, lambda d: (d.mkdir(parents=True), (d / "w").write_bytes(b"old")), {"step": 10})

    def save_then_die(d):
        d.mkdir(parents=True)
        with open(d / "w", "wb") as f:
            f.write(b"half of the new")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # the node dies in the middle of the write

    ck.write_checkpoint(root, 20, save_then_die, {"step": 20})
    """
)


@pytest.mark.parametrize("stage", ["engine state", "before COMPLETE"])
def test_a_checkpoint_cut_off_by_sigkill_is_ignored(tmp_path, stage):
    script = _KILL_MID_WRITE
    if stage == "before COMPLETE":
        # Killed after the rename, just before the marker is written.
        script = script.replace(
            "ck.write_checkpoint(root, 20",
            "ck.write_atomic = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
            "ck.write_checkpoint(root, 20",
        ).replace("save_then_die, {", "lambda d: (d.mkdir(parents=True), (d / 'w').write_bytes(b'new')), {")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "step-00000010"]
    assert leftovers, "the killed write left nothing behind: the test did not cut it off"
    latest = ck.latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 10
    assert (latest.engine_dir / "w").read_bytes() == b"old"
    ck.remove_incomplete(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000010"]


def test_complete_marker_records_the_step(tmp_path):
    c = ck.write_checkpoint(tmp_path, 7, _saver(b"x"), {"step": 7})
    assert json.loads((c.path / ck.COMPLETE).read_text()) == {"step": 7}
