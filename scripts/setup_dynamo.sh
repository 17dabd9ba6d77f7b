#!/usr/bin/env bash
# Separate virtual environment with Dynamo's Python runtime (PyPI `ai-dynamo-runtime`, its own KV
# indexer), for tests/interop/test_dynamo_kv_index.py. The main environment never imports it; the
# test decodes the msgpack payloads itself, so the venv needs nothing else. Re-running it is
# harmless and fast. About 30 s and 280 MB from a warm package index.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DYNAMO_VENV:-.venv-dynamo}
PY=${PYTHON:-python3}
DYNAMO_VERSION=1.6.1
VPY="$VENV/bin/python"

is_ready() {
  [ -x "$VPY" ] && "$VPY" - <<PYEOF 2>/dev/null
import importlib.metadata as m
assert m.version("ai-dynamo-runtime") == "$DYNAMO_VERSION"
from dynamo.llm import RadixTree, compute_block_hash_for_seq
PYEOF
}

if is_ready; then
  echo "dynamo venv ready: $(cd "$VENV" && pwd)"
  exit 0
fi

[ -x "$VPY" ] || "$PY" -m venv "$VENV"
"$VPY" -m pip install -q --disable-pip-version-check "ai-dynamo-runtime==$DYNAMO_VERSION"

if ! is_ready; then
  echo "dynamo venv at $VENV is incomplete after install" >&2
  exit 1
fi
echo "dynamo venv ready: $(cd "$VENV" && pwd)"
