#!/usr/bin/env bash
# The GPU checks in one short run (for a machine with CUDA, e.g. one `device` call):
#   1. the CUDA tests: graph replay == eager for every bucket, sampler on CUDA;
#   2. the decode benchmark on CUDA: graphs vs eager, next to transformers' generate; the step at
#      gpt-oss-20b's shape next to its memory floor (bench_gpu_decode); the host
#      time per decode step on this machine's CPU (bench_step, a quieter host than a shared VM);
#   3. the end-to-end P/D test with both servers on the GPU (VRAM pools registered with NIXL).
# Output goes to stdout and, when $OUT is set, to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log=${OUT:-/tmp}/gpu_check.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
  echo "== tests/gpu"
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -x; rc_gpu=$?
  echo "== bench_decode (cuda)"
  timeout 240 "$PY" scripts/bench_decode.py --device cuda --steps 32; rc_bench=$?
  echo "== bench_gpu_decode (gpt-oss-20b's shape, MXFP4 checkpoint, graphs)"
  timeout 420 "$PY" scripts/bench_gpu_decode.py; rc_gpu_bench=$?
  echo "== bench_step (host time per step; this host's CPU, the stand-in device)"
  timeout 120 "$PY" -m scripts.bench_step --no-real-model --batch-sizes 1,256 --contexts 32768; rc_step=$?
  echo "== e2e P/D on the GPU"
  DECODE_WORKER_MODEL__DEVICE=cuda DECODE_WORKER_MODEL__DTYPE=float32 timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/e2e/test_e2e_pd.py -k direct; rc_e2e=$?
  echo "gpu_check: tests/gpu rc=$rc_gpu bench rc=$rc_bench gpu_bench rc=$rc_gpu_bench step rc=$rc_step e2e rc=$rc_e2e"
} 2>&1 | tee "$log"
