"""The README's commands, run as written: the two of its first block (`bash scripts/demo.sh`; `scripts/test.sh`
is what runs this suite) and every line of its other bash blocks, in order, in a shell that ran the blocks'
`source` and `export` lines, from a directory laid out like the repository's root (its `examples/`, its
`.venv`), with the demo's assets built (as `scripts/demo.sh` leaves them). A `horizon-ray serve` line runs
in the background, as in its own terminal, until the block's other lines are done and the README's Python
snippets that talk to the service (the OpenAI SDK's) have run against it, as written.

Also: the settings table is the code's, and the demo's task list says which task is not scored.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.serving import ROOT, serving, user_env

README = ROOT / "README.md"
COMMENT = re.compile(r"\s{2,}#.*$")


def python_blocks(text: str) -> list[str]:
    """The ```python blocks that talk to the service `serve` starts (on :8000)."""
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "127.0.0.1:8000" in b]


def bash_blocks(text: str) -> list[list[str]]:
    """The command lines of every ```bash block, comments stripped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [[COMMENT.sub("", line).strip() for line in b.splitlines() if COMMENT.sub("", line).strip()]
            for b in blocks]


def test_the_readme_lists_the_settings_table_of_the_code():
    from api.settings import settings_markdown

    assert settings_markdown() in README.read_text()


def test_the_readme_says_which_demo_task_is_not_scored():
    from horizon_ray.data import DEMO_TASKS
    from horizon_ray.job.demo import EVAL_TASKS

    unscored = sorted(set(DEMO_TASKS) - set(EVAL_TASKS))
    assert unscored == ["add"]
    text = " ".join(README.read_text().split())
    assert f"({', '.join(EVAL_TASKS)}; and add, which trains but is not scored" in text


def test_the_readme_points_only_at_files_of_the_repository():
    """Every path the README names in backquotes exists in a clone (tests/unit/test_repo_guards.py keeps
    pointers to files outside the repository out of every file)."""
    text = README.read_text()
    for path in re.findall(r"`((?:docs|k8s|tests|scripts|examples|notebooks|benchmarks|api|horizon_ray)/[^`\s]*)`",
                           text):
        if "<" in path or "{" in path:
            continue
        assert (ROOT / path.rstrip("/")).exists(), f"README names {path}, which the repository does not have"


def _free(port: int) -> bool:
    """Whether serve could bind the port: as uvicorn and Ray do, past sockets of an earlier run in TIME_WAIT."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.integration
@pytest.mark.slow
def test_every_command_of_the_readme_runs_as_written(tmp_path):
    from horizon_ray.job.demo import prepare_demo_assets

    blocks = bash_blocks(README.read_text())
    assert blocks[0] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    if not (_free(8000) and _free(8265)):
        pytest.skip("ports 8000 or 8265 are taken on this machine: the README's serve line uses them")
    ws = tmp_path / "repo"
    ws.mkdir()
    shutil.copytree(ROOT / "examples", ws / "examples")
    (ws / ".venv").symlink_to(ROOT / ".venv")
    home = tmp_path / "home"
    prepare_demo_assets(home)
    env = user_env(home)
    env.pop("VIRTUAL_ENV")
    env["PATH"] = env["PATH"].split(":", 1)[1]  # the README's `source .venv/bin/activate` puts it there
    ran: list[str] = []
    preamble: list[str] = []  # one shell session: what a block sources holds for the next ones
    snippets = python_blocks(README.read_text())
    assert len(snippets) == 1, "the README's OpenAI snippet talks to the service on :8000"
    printed: list[str] = []

    def run(script: str, what: str) -> str:
        out = subprocess.run(["bash", "-c", script], cwd=ws, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, f"`{what}` exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout

    for block in blocks[1:]:
        with _Background() as background:
            for line in block:
                if line.startswith("source "):
                    preamble.append(line)
                    continue
                if line.startswith("export "):  # evaluated once, as the user's shell does: a random key stays one
                    name = line.removeprefix("export ").split("=", 1)[0]
                    # one variable a line: a second one on the line would be lost here, and not in the user's shell
                    assert len(shlex.split(line.split("  #", 1)[0])) == 2, f"one variable an export line: {line}"
                    env[name] = run("\n".join(["set -e", *preamble, line, f'printf %s "${name}"']), line)
                    printed.append("")
                    ran.append(line)
                    continue
                script = "\n".join(["set -e", *preamble, line])
                if line.startswith("horizon-ray serve"):
                    background.start(script, env, ws, tmp_path / f"serve-{len(ran)}.log")
                    printed.append("")
                else:
                    printed.append(run(script, line))
                ran.append(line)
            if background.contexts:  # the Python snippets, in the user's shell, while this serve runs
                for snippet in snippets:
                    (tmp_path / "snippet.py").write_text(snippet)
                    printed.append(run("\n".join(["set -e", *preamble, f"python {tmp_path / 'snippet.py'}"]),
                                       snippet))
                    ran.append(snippet)
    assert any(line.startswith("curl ") and "/finetune" in line for line in ran)
    created = next(json.loads(out) for line, out in zip(ran, printed, strict=True) if line.startswith("curl "))
    assert created["status"] in ("queued", "running", "validating") and created["id"].startswith("job-"), created
    models, status = printed[ran.index(snippets[0])].splitlines()[-2:]
    assert "'demo-tiny'" in models
    assert status in ("validating_files", "queued", "running", "succeeded"), status
    assert any(line.startswith("ray job submit") for line in ran)
    # the service's jobs lie in the tenant's output namespace, <service root>/jobs/<tenant>/
    service_jobs = home / "service" / "jobs" / "me"
    for out_dir in (ws / "runs" / "demo", service_jobs / "demo-service", service_jobs / "demo-rayjob"):
        assert (out_dir / "final" / "model.safetensors").is_file(), f"{out_dir} has no final model"
    assert (ws / "runs" / "demo" / "tensorboard").is_dir()


class _Background:
    """The serve lines of a block, stopped (Ctrl-C) when the block is done."""

    def __init__(self) -> None:
        self.contexts: list = []

    def start(self, script: str, env: dict, cwd: Path, log: Path) -> None:
        ctx = serving(["bash", "-c", script], env, log, cwd=cwd)
        self.contexts.append(ctx)
        ctx.__enter__()
        time.sleep(1)

    def __enter__(self) -> _Background:
        return self

    def __exit__(self, *exc) -> None:
        for ctx in reversed(self.contexts):
            ctx.__exit__(None, None, None)


@pytest.mark.integration
@pytest.mark.slow
def test_the_demo_command_runs_as_written(tmp_path):
    """`bash scripts/demo.sh`: set up (idempotent), then the whole demo through the local service."""
    env = user_env(tmp_path / "home")
    out = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "held-out accuracy" in out.stdout and "the demo's service has stopped" in out.stdout
    finals = list((tmp_path / "home" / "demo" / "service" / "jobs" / "demo").glob("job-*/final/model.safetensors"))
    assert len(finals) == 1
