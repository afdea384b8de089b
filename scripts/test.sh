#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every check CI runs: ruff, mypy, the chart checks
# and the whole test suite, real vLLM end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/pytest -q -p no:cacheprovider "$@"
