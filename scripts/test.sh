#!/usr/bin/env bash
# The project's test command (README and .ci/run call exactly this): lint, types and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check decode_worker tests scripts
# mypy (from a cold cache, as in CI, about a minute of one core) runs beside pytest, whose
# workers leave a core idle while they wait on servers; its report prints as soon as it ends,
# and a type error fails this command as a failing test does.
types=$(mktemp -d)
trap 'kill "$types_pid" 2>/dev/null || true; rm -rf "$types"' EXIT
( set +e; "$PY" -m mypy >"$types/out" 2>&1; echo "$?" >"$types/rc"; cat "$types/out" ) &
types_pid=$!
set +e
# Two pytest-xdist workers (TEST_WORKERS; 0 runs in this process): much of the suite waits on
# child servers, timers and sockets, so two keep both cores busy. A test file runs whole on one
# worker, its tests in order (tests/conftest.py groups them; files sharing a server go together;
# the groups with slow tests first).
"$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
rc=$?
wait "$types_pid"
types_rc=$(cat "$types/rc" 2>/dev/null || echo 1)
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
if [ "$types_rc" -ne 0 ]; then
  echo "mypy failed (its report is above)" >&2
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
