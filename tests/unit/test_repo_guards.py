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


def test_the_package_metadata_builds_without_warnings():
    """setuptools reads pyproject.toml without a deprecation (the license table is one: an SPDX string now)."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
