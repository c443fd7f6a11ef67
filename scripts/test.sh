#!/usr/bin/env bash
# The README's test command: set up, lint, type-check, run every CPU test tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
.venv/bin/ruff check .
.venv/bin/python -m mypy  # horizon_ray and api ([tool.mypy] in pyproject.toml); an error fails the script
.venv/bin/python -m pytest "$@"
