#!/usr/bin/env bash
# The project's test command (README and .ci/run call exactly this): lint, types, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check decode_worker tests scripts
"$PY" -m mypy
set +e
# Two pytest-xdist workers (TEST_WORKERS; 0 runs in this process): much of the suite waits on
# child servers, timers and sockets, so two keep both cores busy. A test file runs whole on one
# worker, its tests in order (tests/conftest.py groups them; files sharing a server go together).
"$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
