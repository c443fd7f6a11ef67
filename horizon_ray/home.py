"""Where horizon-ray keeps its files on a machine: ``$HORIZON_RAY_HOME`` (default ``~/.cache/horizon-ray``).

Under it: ``demo/`` (the demo's assets and runs), ``service/`` (the job table, job outputs and uploads of
``horizon-ray serve``), ``probe.json`` (this node's measured ceilings, ``horizon-ray probe``). A job spec file
may start a path with ``$HORIZON_RAY_HOME`` (``jobspec.expand_path``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOME_VARIABLE = "HORIZON_RAY_HOME"
DEFAULT_HOME = "~/.cache/horizon-ray"


def horizon_home(environ: Mapping[str, str] | None = None) -> Path:
    """``$HORIZON_RAY_HOME``, or ``~/.cache/horizon-ray``."""
    env = os.environ if environ is None else environ
    return Path(env.get(HOME_VARIABLE) or DEFAULT_HOME).expanduser()


def service_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$HORIZON_RAY_HOME/service``: the default root of ``horizon-ray serve`` (job table, jobs/, uploads/)."""
    return horizon_home(environ) / "service"
