#!/usr/bin/env bash
# W4 over two replicas behind `kvserve router`: requests spread over a few long shared
# prefixes (`bench serve --dataset shared-prefix`), once per routing policy, each on fresh
# replicas (empty caches). With a KV cache that holds about half of the prefixes, round-robin
# makes every replica compute (and evict) every prefix; cache-aware routing keeps each prefix
# on one replica. Prints each policy's TTFT and throughput; JSON under $OUT.
#
#   bash benchmarks/cpu_router_w4.sh
#
# Environment: OUT (default /tmp/kvserve-router-w4); POLICIES (default "round_robin
# cache_aware"); SERVE_ARGS for each replica (default: the embedded model, one thread,
# --kv-cache-memory 96MiB --max-model-len 2048); BENCH_ARGS for `bench serve` (default below).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvserve-router-w4}
mkdir -p "$OUT"
PORT=${PORT:-8790}
SERVE_ARGS=${SERVE_ARGS:-"--kv-cache-memory 96MiB --max-model-len 2048 --max-num-seqs 16"}
BENCH_ARGS=${BENCH_ARGS:-"--dataset shared-prefix --num-prefixes 4 --prefix-len 768 --input-len 16 16 \
  --output-len 16 16 --num-prompts 64 --request-rate 1"}
for policy in ${POLICIES:-round_robin cache_aware}; do
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of words
  OMP_NUM_THREADS=1 python3 -m kvserve.entrypoints.cli --log-level WARNING router --port "$PORT" \
    --policy "$policy" --launch 2 -- $SERVE_ARGS > "$OUT/router-$policy.log" 2>&1 &
  router=$!
  for _ in $(seq 600); do  # both replicas healthy (model loads take a while on a busy machine)
    healthy=$(curl -sf "http://127.0.0.1:$PORT/workers" | python3 -c \
      "import json, sys; print(sum(w['healthy'] for w in json.load(sys.stdin)['workers']))" 2>/dev/null || echo 0)
    [ "$healthy" = 2 ] && break
    kill -0 "$router" 2>/dev/null || { echo "the router exited: see $OUT/router-$policy.log" >&2; exit 1; }
    sleep 1
  done
  echo "== $policy"
  # shellcheck disable=SC2086
  python3 -m kvserve.entrypoints.cli --log-level WARNING bench serve --base-url "http://127.0.0.1:$PORT" \
    $BENCH_ARGS --output-json "$OUT/$policy.json" 2>&1 | grep -E "TTFT|throughput|requests|failed" || true
  kill -INT "$router"
  wait "$router" || true
done
