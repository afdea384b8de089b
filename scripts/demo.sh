#!/usr/bin/env bash
# Set up (without vLLM: the demo runs simulated replicas) and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-vllm
.venv/bin/python -m loadgen demo "$@"
