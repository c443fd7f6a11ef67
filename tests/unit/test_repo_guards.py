"""Rules of the repository, as tests: imports, layering, CLI surface, strict YAML examples."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_packages_import():
    import api  # noqa: F401
    import horizon_ray  # noqa: F401


def test_engine_imports_neither_ray_nor_fastapi():
    code = (
        "import sys, horizon_ray.engine\n"
        "bad = [m for m in ('ray', 'fastapi', 'uvicorn', 'starlette') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_help_lists_every_subcommand():
    from horizon_ray.cli import SUBCOMMANDS

    out = subprocess.run(
        [sys.executable, "-m", "horizon_ray", "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert SUBCOMMANDS, "no subcommand is registered"
    for name in SUBCOMMANDS:
        assert name in out, f"`horizon-ray --help` does not list {name}"
