#!/usr/bin/env bash
# One-command set-up on a fresh machine: CPU torch (the wheel on disk when present), then the
# package in editable mode with its test extra. Re-running it is harmless.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch' 2>/dev/null; then
  # 2.13.0 resolves to the CPU wheel in pip's find-links here; elsewhere use the CPU index.
  "$PY" -m pip install -q "torch==2.13.0" \
    || "$PY" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install -q -e ".[test]"
# pyenv puts console scripts behind shims: make `decode-worker` visible at once
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
echo "decode-worker set up: $("$PY" -c 'import decode_worker; print(decode_worker.__version__)')"
