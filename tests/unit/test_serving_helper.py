"""tests/serving.py, the helper every serve-driving integration test starts serve with."""

from __future__ import annotations

import os
from pathlib import Path

from tests.serving import serving


def test_each_serve_gets_a_ray_temp_dir_of_its_own_that_its_commands_share(tmp_path):
    """A command given no address (`ray job submit`, as the README writes it) takes the newest cluster of Ray's
    temp dir: with one dir shared by every test, a cluster that another test or suite started later received
    the job. serving() gives each serve its own dir, in the env the test's other commands run with, and removes
    it when serve stops; a dir the caller chose is left as it is."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"}
    script = 'echo "tmp=$RAY_TMPDIR"; echo ready; sleep 60'
    with serving(["bash", "-c", script], env, tmp_path / "a.log", ready="ready", timeout_s=30):
        first = env["RAY_TMPDIR"]
        assert Path(first).is_dir() and len(first) < 40  # Ray's socket paths under it must fit 107 bytes
        assert f"tmp={first}" in (tmp_path / "a.log").read_text()
    assert "RAY_TMPDIR" not in env and not Path(first).exists()
    with serving(["bash", "-c", script], env, tmp_path / "b.log", ready="ready", timeout_s=30):
        assert env["RAY_TMPDIR"] != first  # not the dir of the serve before it
    chosen = tmp_path / "mine"
    chosen.mkdir()
    env["RAY_TMPDIR"] = str(chosen)
    with serving(["bash", "-c", script], env, tmp_path / "c.log", ready="ready", timeout_s=30):
        assert env["RAY_TMPDIR"] == str(chosen)
    assert env["RAY_TMPDIR"] == str(chosen) and chosen.is_dir()
