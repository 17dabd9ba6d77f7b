#!/usr/bin/env bash
# The GPU checks in one prepared run, for a lent GPU machine (one `device` call) or any CUDA box.
#
# Prepare here first: `bash scripts/gpu_wheels.sh` puts the wheels the device image lacks in
# .whl/ (docs/GPU.md, "Target device image"); carry `.whl` with the call. This script unpacks them
# into a scratch folder put first on PYTHONPATH (the checkout after it), then runs, each part
# with its own timeout (the whole under 8 minutes):
#   imports   every module the daemon and the tests need, and the versions
#   tests/gpu the CUDA tests (graph replay == eager, kernels, decode inputs, sampler)
#   e2e       the P/D end-to-end test on the GPU (VRAM pools over NIXL), native and SGLang
#             protocols, token-exact against transformers in float32; and every family
#             (Llama 3, Qwen3, Qwen3-MoE, Gemma 3: tests/e2e/test_e2e_families.py, native)
#   demo      `decode-worker demo` on the GPU (three processes sharing the card), on
#             MODEL=DIR when set (any supported model directory), else the built-in gpt-oss
#   bench     scripts/bench_gpu_decode.py (gpt-oss-20b's shape), or bench_decode.py on CUDA
#   hosttier  scripts/gpu_host_tier.py: host-tier restore bandwidth vs pinned host-to-device
# Logs go to $OUT (default /tmp/gpu_check), one file a part; the last lines are a table of the
# parts, the host tier's line and the benchmark's contract line. Without CUDA the CUDA parts are skipped, saying why
# (exit 0); a failed part makes the exit status 1.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if compgen -G ".whl/*-$tag-*.whl" >/dev/null; then
  rm -rf "$SITE" && mkdir -p "$SITE"
  for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: unpacked $(ls .whl/*.whl | wc -l) wheels from .whl into $SITE"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: no $tag wheels in .whl: using the installed packages"
fi
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then cuda=1; else cuda=0; fi

rows=()
part() {  # part NAME TIMEOUT_S NEEDS_CUDA CMD...: run CMD, log it, add a row to the table
  local name=$1 limit=$2 needs=$3 result
  shift 3
  local log="$OUT/${name//\//_}.log" t0=$SECONDS
  echo "== $name (timeout ${limit} s, log $log)"
  if [ "$needs" = 1 ] && [ "$cuda" = 0 ]; then
    echo "skipped: no CUDA device (torch.cuda.is_available() is False)" | tee "$log"
    rows+=("$(printf '  %-10s %-8s %5s s' "$name" skip 0)")
    return
  fi
  timeout "$limit" "$@" >"$log" 2>&1
  case $? in
    0) result=pass ;;
    124 | 137) result=timeout ;;
    *) result=fail ;;
  esac
  tail -n 15 "$log"
  rows+=("$(printf '  %-10s %-8s %5s s' "$name" "$result" $((SECONDS - t0)))")
}

part imports 60 0 "$PY" - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
      torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    print("device", torch.cuda.get_device_name(), f"{free / 2**30:.1f} / {total / 2**30:.1f} GiB free")
missing = []
for name in ("triton", "pydantic", "pydantic_settings", "msgspec", "zmq", "uvicorn", "httptools",
             "nixl", "xgrammar", "prometheus_client", "safetensors", "tokenizers", "numpy",
             "uvloop", "transformers", "pytest", "decode_worker"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name} {getattr(mod, '__version__', '')}")
    except Exception as exc:  # report every missing one, then fail
        missing.append(f"{name} ({exc.__class__.__name__}: {exc})")
if missing:
    sys.exit("missing: " + "; ".join(missing))
EOF
part tests/gpu 150 1 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
part e2e 270 1 env DECODE_WORKER_MODEL__DEVICE=cuda DECODE_WORKER_MODEL__DTYPE=float32 \
  "$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_e2e_pd.py tests/e2e/test_e2e_families.py \
  -k "direct or (cold_partial and native)"
part demo 100 1 env DECODE_WORKER_MODEL__DEVICE=cuda \
  "$PY" -m decode_worker demo --turns 2 --conversations 2 --max-new-tokens 16 \
  ${MODEL:+--model "$MODEL"}
if [ -f scripts/bench_gpu_decode.py ]; then
  part bench 200 1 "$PY" scripts/bench_gpu_decode.py
else
  part bench 150 1 "$PY" scripts/bench_decode.py --device cuda --steps 16 --batch-sizes 1,8,32
fi
part hosttier 90 1 "$PY" scripts/gpu_host_tier.py

echo "gpu_check: part       result   time"
printf '%s\n' "${rows[@]}"
hosttier=$(grep -h '^gpu_host_tier: restore_gbps=' "$OUT/hosttier.log" 2>/dev/null | tail -n 1)
echo "${hosttier:-gpu_host_tier: not run}"
contract=$(grep -h '^bench_gpu_decode:' "$OUT/bench.log" 2>/dev/null | tail -n 1)
echo "${contract:-bench_gpu_decode: not run}"
for row in "${rows[@]}"; do
  case $row in *" fail "* | *" timeout "*) exit 1 ;; esac
done
exit 0
