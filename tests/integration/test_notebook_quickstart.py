"""notebooks/quickstart.ipynb, executed top to bottom with nbclient on this interpreter's kernel.

The notebook starts a local Ray cluster of simulated nodes, the service and its API, trains the demo model
through the REST API, plots the loss and loads the result with transformers. It runs CPU-only in a few
minutes. Everything it starts carries a marker in its environment and gets its own Ray temp dir, so the
test stops exactly those processes afterwards, even when a cell fails (other Ray tests may run beside it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
KERNEL = "horizon-ray-test"
MARKER = "HORIZON_NOTEBOOK_TEST_ID"  # set in the kernel's environment; inherited by all it starts


def kill_marked(marker_value: str) -> list[int]:
    """SIGKILL every process whose environment carries our marker (the kernel, Ray's processes, the
    engines); returns their pids."""
    import psutil

    killed = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARKER) == marker_value:
                proc.send_signal(signal.SIGKILL)
                killed.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return killed


def cell_with_tag(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}"
    return cells[0]


def stdout_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


def test_quickstart_notebook_runs_green(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat (dev extra) reads the notebook")
    nbclient = pytest.importorskip("nbclient", reason="nbclient (dev extra) executes the notebook")
    pytest.importorskip("ipykernel", reason="ipykernel (dev extra) is the notebook's kernel")

    # A kernelspec for this very interpreter, so the notebook runs against the code under test.
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "horizon-ray (tests)", "language": "python"}))
    ray_tmp = Path(tempfile.mkdtemp(prefix="hrnb-", dir="/tmp"))  # short: Ray's socket paths must fit
    marker = uuid.uuid4().hex
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv(MARKER, marker)
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))  # this cluster's sessions, sockets and logs
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("HORIZON_RAY_HOME", str(tmp_path / "home"))  # demo assets
    monkeypatch.setenv("HORIZON_QUICKSTART_DIR", str(tmp_path / "work"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("HORIZON_QUICKSTART_STEPS", raising=False)  # the steps a reader runs
    from tests.serving import free_port

    # the API binds a port the OS picks (the notebook's default), read back from what it prints; Ray's head can
    # only be told a number (the port knob of notebooks/README.md)
    ray_port = free_port()
    monkeypatch.delenv("HORIZON_QUICKSTART_PORT", raising=False)
    monkeypatch.setenv("HORIZON_QUICKSTART_RAY_PORT", str(ray_port))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=600, startup_timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    finally:
        kill_marked(marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)

    printed = "".join(stdout_of(c) for c in nb.cells if c.cell_type == "code")
    api = re.search(r"API on http://127\.0\.0\.1:(\d+) \(dashboard at http://127\.0\.0\.1:(\d+)/\)", printed)
    assert api and int(api[1]) > 0 and api[1] == api[2], printed
    assert f"Ray cluster at 127.0.0.1:{ray_port}" in printed
    summary = json.loads(stdout_of(cell_with_tag(nb, "summary")).strip().splitlines()[-1])
    assert summary["status"] == "succeeded"
    assert summary["steps"] == 60
    # Placement by RAM: the demo job plans ~580 MiB, more than the small node's 512 MiB.
    assert summary["node"] == "big"
    first, last = summary["train_loss"]
    assert last < 0.6 * first, summary["train_loss"]
    before, after = summary["eval_loss"]
    assert after < before, summary["eval_loss"]
    assert len(summary["generations"]) == 4 and all(isinstance(g["answer"], str) for g in summary["generations"])

    plot = cell_with_tag(nb, "loss-curve")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "the loss curve was not drawn"
    assert (tmp_path / "work" / "loss_curve.png").stat().st_size > 1000
    assert "stopped" in stdout_of(cell_with_tag(nb, "shutdown"))
    assert cell_with_tag(nb, "shutdown") is nb.cells[-1], "the notebook must end by stopping the cluster"
