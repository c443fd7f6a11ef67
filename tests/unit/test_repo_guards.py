"""Rules of the repository, as tests: imports, layering, CLI surface, strict YAML examples."""

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_nothing_points_outside_the_repository():
    """Code, --help text, printed plans and docs point only at files a clone has: no shared folder of the build
    machine beside the repository, no design or style notes that are not in it (docs/ holds what users need).
    The benchmark results quote the commands of past runs as they were run, and stay as recorded."""
    import re

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pointer = re.compile(r"\.\./shared|/work/|shared/(bench|kuberay)|(?<![\w/])(DESIGN|STYLE)\.md|"
                         r"(?<!docs/)ceilings\.md")
    found = []
    for name in files:
        if name.startswith("benchmarks/result") or name in ("benchmarks/RESULTS.md", "tests/unit/test_repo_guards.py") \
                or name.endswith(
                (".png", ".json", ".safetensors")) or not (ROOT / name).is_file():
            continue
        text = (ROOT / name).read_text(errors="replace")
        found += [f"{name}: {m.group(0)}" for m in pointer.finditer(text)
                  if not (name == "docs/ceilings.md" and m.group(0) == "ceilings.md")]
    assert not found, found
    for command in ("plan", "serve", "probe", "finetune"):
        out = subprocess.run([sys.executable, "-m", "horizon_ray", command, "--help"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        assert not pointer.search(out), (command, pointer.search(out))


def test_no_run_output_is_tracked():
    """A job run's outputs never enter the repository (a test's Ray job once left from-ray-jobs/ in the tree, and
    it was committed): no tracked file is a run's marker, metrics, lease or TensorBoard log, and git ignores the
    run directories tests and the README make (`git add -A` takes nothing of them)."""
    from horizon_ray.job.lease import LOCK_FILE
    from horizon_ray.job.metrics import METRICS_FILE
    from horizon_ray.job.runner import DONE

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    markers = {METRICS_FILE, DONE, LOCK_FILE, ".lock", "loss_curve.png"}
    tracked = [f for f in files if Path(f).name in markers or ".tfevents." in Path(f).name]
    assert not tracked, f"a run's outputs are tracked: {tracked}"
    for run_dir in ("from-ray-jobs", "runs/demo", "outputs/x", "checkpoints/step-1"):
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{run_dir}/{METRICS_FILE}"], cwd=ROOT)
        assert ignored.returncode == 0, f"git would add {run_dir}/: add it to .gitignore"


@pytest.mark.parametrize("constant", ["METRICS_FILE", "SPEC_FILE"])
def test_a_jobs_file_names_are_named_in_one_place(constant):
    """The names of a job's files (horizon_ray/job/metrics.py: METRICS_FILE, SPEC_FILE) everywhere they are
    opened or served: a second literal would drift from it."""
    import re

    from horizon_ray.job import metrics

    name = getattr(metrics, constant)
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    literal = re.compile(r"""["']""" + re.escape(name) + r"""["']""")
    found = [f"{path}:{n}" for path in files if not path.startswith("tests/") and (ROOT / path).is_file()
             for n, line in enumerate((ROOT / path).read_text().splitlines(), 1)
             if literal.search(line) and not line.startswith(f"{constant} = ")]
    assert not found, f"use {constant} from horizon_ray.job.metrics: {found}"


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` (import-linter, the contracts in pyproject.toml) over the packages under `root`."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=root,
                          env={**env, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=300)


def test_the_test_command_type_checks_before_the_tests():
    """scripts/test.sh (the README's test command, run by CI) fails on a mypy error before pytest starts, and
    the dev extras that CI installs bring mypy."""
    import tomllib

    lines = [ln.split("#")[0].strip() for ln in (ROOT / "scripts" / "test.sh").read_text().splitlines()]
    assert "set -euo pipefail" in lines
    steps = [ln for ln in lines if ln.startswith(".venv/bin/")]
    assert ".venv/bin/python -m mypy" in steps, steps
    assert steps.index(".venv/bin/python -m mypy") < next(i for i, s in enumerate(steps) if " -m pytest" in s)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(d.startswith("mypy") for d in project["project"]["optional-dependencies"]["dev"])
    assert project["tool"]["mypy"]["packages"] == ["horizon_ray", "api"]
    assert "ignore_errors" not in str(project["tool"]["mypy"])  # no module is exempt


def test_every_import_keeps_to_its_layer():
    """The import contracts of pyproject.toml hold: the engine takes nothing of Ray, the web or the service;
    the job and the planner nothing of Ray or the web; the cluster nothing of the API, the API nothing of the
    agent; nothing imports up the stack commands > api > cluster > job > data > engine."""
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in result.stdout


def test_an_upward_import_breaks_the_contracts(tmp_path):
    """The check can fail: a copy of the tree where the cluster imports the API, and the engine Ray."""
    import shutil

    for name in ("horizon_ray", "api"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "horizon_ray" / "cluster" / "store.py", "a") as f:
        f.write("\nimport api.errors  # noqa\n")
    with open(tmp_path / "horizon_ray" / "engine" / "store.py", "a") as f:
        f.write("\nimport ray  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "horizon_ray.cluster.store -> api.errors" in result.stdout
    assert "horizon_ray.engine.store -> ray" in result.stdout
    assert "Contracts: 1 kept, 4 broken." in result.stdout  # each stack contract sees one of the two


def test_the_readme_layout_matches_the_tree():
    """Every package of horizon_ray is in the README's layout, and every path the layout names exists."""
    import re

    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed = [m.group(1).rstrip("/") for m in re.finditer(r"^(\S+/)\s", block, re.M)]
    assert listed, block
    missing = [p for p in listed if not (ROOT / p).is_dir()]
    assert not missing, f"the README's layout names what the tree lacks: {missing}"
    packages = sorted(f"horizon_ray/{p.name}" for p in (ROOT / "horizon_ray").iterdir()
                      if (p / "__init__.py").is_file())
    unlisted = [p for p in packages if p not in listed]
    assert not unlisted, f"packages missing from the README's layout: {unlisted}"
