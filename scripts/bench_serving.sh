#!/usr/bin/env bash
# Serving benchmark: SGLang's own `python -m sglang.bench_serving` through the SGLang Model Gateway
# (smg 1.13, PD mode) in front of the reference prefill peer and the decode worker; the decode radix cache on,
# then off (cache.decode_radix_cache=false). A benchmark, not a test: CI does not run it.
#
#   bash scripts/bench_serving.sh                      # the built-in tiny gpt-oss, small counts
#   MODEL=DIR NUM_PROMPTS=200 CONCURRENCY=16 bash scripts/bench_serving.sh
#
# Data sets: `sharegpt` from a ShareGPT-format file made here (scripts/bench_sharegpt_data.py;
# nothing can be downloaded) and `generated-shared-prefix` (groups of prompts sharing a long
# system prompt). Backends: $BACKENDS (sglang = /generate, sglang-oai = /v1/completions,
# sglang-oai-chat = /v1/chat/completions). Each run flushes both workers' caches first
# (--flush-cache, through the router), prints bench_serving's tables (throughput, TTFT, TPOT, ITL)
# and then the KV bytes the decode worker received during it (decode_worker_transfer_bytes_total,
# bench_serving's warm-up request included) and its prefix-cache hit tokens; a summary table
# closes the output.
#
# Router: $ROUTER_MODULE (smg.launch_router; sglang_router.launch_router for sglang-router 0.3.2),
# started as a module from $PYTHON (both packages install a `smg` console script), with
# $ROUTER_POLICY (round_robin).
# Environment: its own venv $BENCH_VENV (.venv-bench): SGLang 0.5.23 from .venv-sglang
# (scripts/setup_sglang.sh, linked in by a .pth file) plus the `datasets` package that
# sglang.bench_serving imports. Servers run from this checkout's python ($PYTHON).
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: bash scripts/bench_serving.sh            (settings are environment variables)

SGLang's bench_serving through smg (PD mode) in front of the reference prefill peer and a decode
worker, the decode radix cache on, then off; prints bench_serving's tables and the KV bytes the
decode worker received. The first run builds .venv-sglang (scripts/setup_sglang.sh, about 3 GB)
and .venv-bench; nothing is installed or started for --help or a wrong argument.

  MODEL=DIR            model directory (default: the built-in tiny gpt-oss)
  NUM_PROMPTS=N        prompts per run (16)
  OUTPUT_LEN=N         output tokens per request (24)
  CONCURRENCY=N        concurrent requests (4)
  BACKENDS=".."        bench_serving backends ("sglang sglang-oai sglang-oai-chat")
  DATASETS=".."        data sets ("sharegpt generated-shared-prefix")
  CACHES=".."          decode radix cache settings to run ("on off")
  ROUTER_MODULE=M      router module (smg.launch_router; sglang_router.launch_router)
  ROUTER_POLICY=P      router policy (round_robin)
  SGLANG_VENV, BENCH_VENV, BENCH_OUT, PYTHON, SERVER_TIMEOUT_S: see the script header
USAGE
}
if [ $# -gt 0 ]; then
  case "$1" in
    -h|--help) usage; exit 0 ;;
    *) echo "bench_serving: unknown argument '$1' (settings are environment variables)" >&2
       usage >&2; exit 2 ;;
  esac
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
VENV=${BENCH_VENV:-.venv-bench}
OUT=${BENCH_OUT:-out/bench_serving}
NUM_PROMPTS=${NUM_PROMPTS:-16}
OUTPUT_LEN=${OUTPUT_LEN:-24}
CONCURRENCY=${CONCURRENCY:-4}
BACKENDS=${BACKENDS:-"sglang sglang-oai sglang-oai-chat"}
DATASETS=${DATASETS:-"sharegpt generated-shared-prefix"}
CACHES=${CACHES:-"on off"}
SERVER_TIMEOUT_S=${SERVER_TIMEOUT_S:-3600}  # every server is bounded by `timeout`
ROUTER_MODULE=${ROUTER_MODULE:-smg.launch_router}
ROUTER_POLICY=${ROUTER_POLICY:-round_robin}
BPY="$VENV/bin/python"
mkdir -p "$OUT"

# -- the benchmark's venv ----------------------------------------------------------------------
SGLANG_VENV="$SGLANG_VENV" bash scripts/setup_sglang.sh >&2
if ! "$BPY" -c "import sglang.bench_serving" >/dev/null 2>&1; then
  [ -x "$BPY" ] || "$PY" -m venv "$VENV"
  site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
  (cd "$(site_of "$SGLANG_VENV/bin/python")" && pwd) > "$(site_of "$BPY")/_sglang_venv.pth"
  "$BPY" -m pip install -q --disable-pip-version-check \
    -c "$SGLANG_VENV/constraints-sglang.txt" "datasets>=3"
  "$BPY" -c "import sglang.bench_serving" >/dev/null 2>&1 \
    || { echo "bench_serving: sglang.bench_serving does not import in $VENV" >&2; exit 1; }
fi

# -- model and data ----------------------------------------------------------------------------
if [ -z "${MODEL:-}" ]; then
  MODEL=$("$PY" -c 'from pathlib import Path
from decode_worker.device.default_model import ensure_default_model
print(ensure_default_model(Path.home() / ".cache" / "decode-worker"))')
fi
SHAREGPT="$OUT/sharegpt-local.json"
"$PY" -m scripts.bench_sharegpt_data --out "$SHAREGPT" --conversations 400 --seed 0 >&2

# -- servers -----------------------------------------------------------------------------------
PIDS=()
stop_all() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT
port() { "$PY" -c 'from decode_worker.daemon.shared.procs import free_port; print(free_port())'; }
ported() {  # ported FILE NAME SECONDS: the port NAME from a server's --ports-file, once written
  local deadline=$((SECONDS + $3))
  while [ "$SECONDS" -lt "$deadline" ]; do
    if [ -s "$1" ]; then
      "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
      return 0
    fi
    sleep 0.5
  done
  echo "bench_serving: no ports in $1 after $3 s (logs in $OUT)" >&2
  return 1
}
wait_url() {  # wait_url URL SECONDS [PYTHON-CHECK-ON-BODY [PID]]: fails at once if PID exits
  local deadline=$((SECONDS + $2)) body
  while [ "$SECONDS" -lt "$deadline" ]; do
    if [ -n "${4:-}" ] && ! kill -0 "$4" 2>/dev/null; then
      echo "bench_serving: the server for $1 exited (logs in $OUT)" >&2
      return 1
    fi
    if body=$(curl -sf --max-time 2 "$1" 2>/dev/null) \
        && { [ -z "${3:-}" ] || echo "$body" | "$PY" -c "$3" 2>/dev/null; }; then
      return 0
    fi
    sleep 0.5
  done
  echo "bench_serving: $1 not ready after $2 s (logs in $OUT)" >&2
  return 1
}
metric() {  # metric URL NAME: the sum of NAME's samples on URL/metrics
  curl -sf --max-time 10 "$1/metrics" | awk -v n="$2" \
    '$1 == n || index($1, n "{") == 1 { s += $NF } END { printf "%d\n", s }'
}

start_stack() {  # start_stack on|off: prefill peer, decode worker, router; sets the URLs
  local cache=$1 pp bp dp rp radix=true
  [ "$cache" = off ] && radix=false
  # the servers bind free ports themselves and report them (--ports-file): no race
  rm -f "$OUT/prefill-$cache.ports" "$OUT/decode-$cache.ports"
  timeout "$SERVER_TIMEOUT_S" "$PY" -m decode_worker prefill --model "$MODEL" --port 0 \
    --bootstrap-port 0 --ports-file "$OUT/prefill-$cache.ports" \
    > "$OUT/prefill-$cache.log" 2>&1 & PIDS+=($!)
  timeout "$SERVER_TIMEOUT_S" "$PY" -m decode_worker serve --model "$MODEL" --port 0 \
    --ports-file "$OUT/decode-$cache.ports" \
    --set "cache.decode_radix_cache=$radix" > "$OUT/decode-$cache.log" 2>&1 & PIDS+=($!)
  pp=$(ported "$OUT/prefill-$cache.ports" http 300); bp=$(ported "$OUT/prefill-$cache.ports" bootstrap 5)
  dp=$(ported "$OUT/decode-$cache.ports" http 300)
  PREFILL="http://127.0.0.1:$pp" DECODE="http://127.0.0.1:$dp"
  wait_url "$PREFILL/health" 300
  wait_url "$DECODE/health" 300
  # the router cannot bind port 0 and report it: its ports are picked here, and it starts
  # again on fresh ones when another process took one first
  local try
  for try in 1 2 3; do
    rp=$(port) ROUTER="http://127.0.0.1:$rp"
    timeout "$SERVER_TIMEOUT_S" "$PY" -m "$ROUTER_MODULE" --pd-disaggregation \
      --prefill "$PREFILL" "$bp" --decode "$DECODE" --host 127.0.0.1 --port "$rp" \
      --prometheus-host 127.0.0.1 --prometheus-port "$(port)" --policy "$ROUTER_POLICY" \
      --worker-startup-check-interval 1 --health-check-interval-secs 5 \
      --request-timeout-secs 600 --disable-circuit-breaker > "$OUT/router-$cache.log" 2>&1 &
    PIDS+=($!)
    if wait_url "$ROUTER/workers" 120 'import json, sys
w = json.load(sys.stdin); w = w.get("workers", w) if isinstance(w, dict) else w
sys.exit(0 if isinstance(w, list) and len(w) >= 2 else 1)' "$!"; then
      return 0
    fi
    grep -q "Address already in use" "$OUT/router-$cache.log" || break
    echo "bench_serving: a router port was taken; starting it again on fresh ports" >&2
  done
  return 1
}

run_bench() {  # run_bench CACHE DATASET BACKEND: one bench_serving run, then its KV bytes
  local cache=$1 dataset=$2 backend=$3 name bytes0 hits0 bytes hits
  name="$cache-$dataset-$backend"
  local args=(--backend "$backend" --base-url "$ROUTER" --model "$SERVED" --tokenizer "$MODEL"
              --dataset-name "$dataset" --num-prompts "$NUM_PROMPTS" --seed 1
              --max-concurrency "$CONCURRENCY" --request-rate inf --pd-separated --flush-cache
              --disable-tqdm --output-file "$OUT/results.jsonl")
  if [ "$dataset" = sharegpt ]; then
    args+=(--dataset-path "$SHAREGPT" --sharegpt-output-len "$OUTPUT_LEN")
  else
    args+=(--gsp-num-groups 4 --gsp-prompts-per-group $(((NUM_PROMPTS + 3) / 4))
           --gsp-system-prompt-len 384 --gsp-question-len 48 --gsp-output-len "$OUTPUT_LEN")
  fi
  bytes0=$(metric "$DECODE" decode_worker_transfer_bytes_total)
  hits0=$(metric "$DECODE" decode_worker_prefix_cache_hit_tokens_total)
  echo "=== bench_serving: decode radix cache $cache, $dataset, backend $backend ==="
  if ! PYTHONWARNINGS=ignore timeout 900 "$BPY" -m sglang.bench_serving "${args[@]}" \
      > "$OUT/bench-$name.out" 2> "$OUT/bench-$name.err"; then
    echo "bench_serving failed; its output: $OUT/bench-$name.{out,err}"
    tail -n 5 "$OUT/bench-$name.err"
  fi
  sed -n '/Serving Benchmark Result/,$p' "$OUT/bench-$name.out"
  bytes=$(( $(metric "$DECODE" decode_worker_transfer_bytes_total) - bytes0 ))
  hits=$(( $(metric "$DECODE" decode_worker_prefix_cache_hit_tokens_total) - hits0 ))
  echo "KV bytes moved (decode_worker_transfer_bytes_total): $bytes"
  echo "decode prefix-cache hit tokens: $hits"
  SUMMARY+=("$(printf '%-5s %-24s %-16s %s %s %s' "$cache" "$dataset" "$backend" \
    "$(grep -E '^Output token throughput' "$OUT/bench-$name.out" | awk '{print $NF}')" \
    "$(grep -E '^Mean TTFT' "$OUT/bench-$name.out" | awk '{print $NF}')" "$bytes $hits")")
}

SUMMARY=()
rm -f "$OUT/results.jsonl"
for cache in $CACHES; do
  start_stack "$cache"
  SERVED=$(curl -sf "$DECODE/v1/models" | "$PY" -c 'import json, sys
print(json.load(sys.stdin)["data"][0]["id"])')
  for dataset in $DATASETS; do
    for backend in $BACKENDS; do
      run_bench "$cache" "$dataset" "$backend"
    done
  done
  stop_all
done

echo "=== summary: $NUM_PROMPTS prompts per run, concurrency $CONCURRENCY ==="
printf '%-5s %-24s %-16s %s\n' cache dataset backend \
  "output_tok/s mean_TTFT_ms kv_bytes_moved prefix_hit_tokens"
printf '%s\n' "${SUMMARY[@]}"
