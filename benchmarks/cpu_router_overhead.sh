#!/usr/bin/env bash
# What `kvserve router` adds, in one run: first against a null worker (answers at once: the
# router's own latency and stream capacity, `python -m kvserve.benchmarks.router_overhead`),
# then 64 concurrent streams on the embedded model, sent to `kvserve serve` directly and
# through a router in front of it, alternated for ROUNDS rounds (output tok/s of each).
#
#   bash benchmarks/cpu_router_overhead.sh
#
# Environment: OUT (default /tmp/kvserve-router-overhead); ROUNDS (default 3); SERVE_ARGS for
# the replica (default --max-num-seqs 64); BENCH_ARGS for `bench serve`.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvserve-router-overhead}
mkdir -p "$OUT"
SERVE_PORT=${SERVE_PORT:-8791}
ROUTER_PORT=${ROUTER_PORT:-8792}
BENCH_ARGS=${BENCH_ARGS:-"--num-prompts 64 --max-concurrency 64 --input-len 32 32 --output-len 64 64"}
python3 -m kvserve.benchmarks.router_overhead --output-json "$OUT/null-worker.json"
# shellcheck disable=SC2086  # SERVE_ARGS is a list of words
python3 -m kvserve.entrypoints.cli --log-level WARNING serve --port "$SERVE_PORT" \
  ${SERVE_ARGS:---max-num-seqs 64} > "$OUT/serve.log" 2>&1 &
serve=$!
python3 -m kvserve.entrypoints.cli --log-level WARNING router --port "$ROUTER_PORT" \
  --worker "http://127.0.0.1:$SERVE_PORT" > "$OUT/router.log" 2>&1 &
router=$!
trap 'kill -INT $router $serve 2>/dev/null; wait' EXIT
until curl -sf "http://127.0.0.1:$ROUTER_PORT/health" > /dev/null; do
  kill -0 "$serve" 2>/dev/null || { echo "the server exited: see $OUT/serve.log" >&2; exit 1; }
  sleep 1
done
# One warm-up pass so the first timed round does not pay for the first steps' set-up.
# shellcheck disable=SC2086
python3 -m kvserve.entrypoints.cli --log-level WARNING bench serve --base-url "http://127.0.0.1:$SERVE_PORT" \
  --num-prompts 8 --input-len 32 32 --output-len 8 8 > /dev/null
for round in $(seq "${ROUNDS:-3}"); do
  for target in direct router; do
    port=$SERVE_PORT; [ "$target" = router ] && port=$ROUTER_PORT
    # shellcheck disable=SC2086
    python3 -m kvserve.entrypoints.cli --log-level WARNING bench serve --base-url "http://127.0.0.1:$port" \
      $BENCH_ARGS --seed "$round" --output-json "$OUT/$target-$round.json" > /dev/null
    python3 -c "import json; d = json.load(open('$OUT/$target-$round.json')); \
print('round $round $target: %.1f output tok/s, TTFT p50 %.0f ms' % (d['output_throughput'], d['ttft_ms']['p50']))"
  done
done
