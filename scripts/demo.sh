#!/usr/bin/env bash
# The README's main-job command: set up, then fine-tune the embedded demo model end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec .venv/bin/horizon-ray demo "$@"
