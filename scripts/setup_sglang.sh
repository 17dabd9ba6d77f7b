#!/usr/bin/env bash
# Separate virtual environment with SGLang 0.5.23's own PD transfer code on CPU, for the interop
# tests in tests/interop/sglang_prefill/ (see its README and docs/PROTOCOLS.md, "Running SGLang's
# own code on a CPU"). The main environment never imports it. Re-running it is harmless and fast.
#
# sglang's declared dependencies want a CUDA torch and GPU kernels, so sglang and triton go in
# with --no-deps on top of the CPU torch and the few packages the disaggregation code imports.
# PyPI's torchvision does not load beside torch 2.13.0+cpu: an inert placeholder package stands
# in (tests/interop/sglang_prefill/torchvision_placeholder.py says why and what it does).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
TRITON_VERSION=3.9.0
# same NIXL as the main environment: both ends of a transfer must run the same version
NIXL_VERSION=1.5.1
VPY="$VENV/bin/python"
PLACEHOLDER=tests/interop/sglang_prefill/torchvision_placeholder.py
PLACEHOLDER_REVISION=$(sed -n 's/^PLACEHOLDER_REVISION = \([0-9]*\)$/\1/p' "$PLACEHOLDER")

is_ready() {
  [ -x "$VPY" ] && "$VPY" - <<EOF 2>/dev/null
import importlib.metadata as m
import importlib.util as u
assert m.version("sglang") == "$SGLANG_VERSION"
assert m.version("torch").split("+")[0] == "$TORCH_VERSION"
assert m.version("nixl") == "$NIXL_VERSION"
# openai, partial_json_parser: sglang.srt.mem_cache imports them (scripts/bench_radix.py --compare-sglang)
assert all(u.find_spec(n) for n in (
    "sglang", "torch", "nixl", "triton", "openai", "partial_json_parser"))
import torchvision
assert torchvision.PLACEHOLDER_REVISION == $PLACEHOLDER_REVISION
EOF
}

if is_ready; then
  echo "sglang venv ready: $(cd "$VENV" && pwd)"
  exit 0
fi

[ -x "$VPY" ] || "$PY" -m venv "$VENV"
# pin the CPU build for every step: no package's requirement can pull a CUDA torch (PyPI's
# plain torch==2.13.0 is one); without the CPU wheel the install fails instead
CONSTRAINTS="$VENV/constraints-sglang.txt"
echo "torch==$TORCH_VERSION+cpu" >"$CONSTRAINTS"
PIP=("$VPY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
# the CPU wheel lies on disk (pip's find-links); elsewhere take it from the CPU index
"${PIP[@]}" "torch==$TORCH_VERSION+cpu" \
  || "${PIP[@]}" "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
"${PIP[@]}" "nixl==$NIXL_VERSION" \
  pyzmq msgspec msgpack requests aiohttp numpy orjson psutil pybase64 packaging pillow \
  starlette pydantic tqdm ipython dill "apache-tvm-ffi==0.1.11" "transformers==5.19.0" \
  fastapi uvicorn openai partial-json-parser "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" "triton==$TRITON_VERSION"

SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/torchvision"
cp "$PLACEHOLDER" "$SITE/torchvision/__init__.py"

if ! is_ready; then
  echo "sglang venv at $VENV is incomplete after install" >&2
  exit 1
fi
echo "sglang venv ready: $(cd "$VENV" && pwd)"
