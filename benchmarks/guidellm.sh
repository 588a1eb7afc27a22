#!/usr/bin/env bash
# guidellm (the vLLM project's load generator) against `kvserve serve` on the default model.
#
# guidellm pins its own dependencies, so it lives in a venv of its own that sees this
# environment's packages (torch, transformers) without moving their versions.
#
#   benchmarks/guidellm.sh                                # venv if needed, own server, run, stop
#   TARGET=http://127.0.0.1:8000 benchmarks/guidellm.sh   # against a server already running
#
# Environment:
#   GUIDELLM        guidellm executable (default: $GUIDELLM_VENV/bin/guidellm, created if missing)
#   GUIDELLM_VENV   where to create the venv (default: ~/.cache/kvserve/guidellm-venv)
#   TARGET          server base URL (default: start `kvserve serve $SERVE_ARGS` on a free port)
#   SERVE_ARGS      extra `kvserve serve` flags for the server this script starts
#   REQUESTS=32 STREAMS=4 PROMPT_TOKENS=32 OUTPUT_TOKENS=16
#   OUTPUT          guidellm's JSON report (default: guidellm.json)
# guidellm needs a tokenizer to size its synthetic prompts; the hub may be unreachable, so the
# default model's tokenizer (read from its GGUF file) is saved locally and passed by path.
set -euo pipefail

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi

PYTHON=${PYTHON:-python3}
GUIDELLM_VENV=${GUIDELLM_VENV:-$HOME/.cache/kvserve/guidellm-venv}
REQUESTS=${REQUESTS:-32}
STREAMS=${STREAMS:-4}
PROMPT_TOKENS=${PROMPT_TOKENS:-32}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-16}
OUTPUT=${OUTPUT:-guidellm.json}

if [[ -z "${GUIDELLM:-}" ]]; then
    GUIDELLM=$GUIDELLM_VENV/bin/guidellm
    if [[ ! -x "$GUIDELLM" ]]; then
        "$PYTHON" -m venv --system-site-packages "$GUIDELLM_VENV"
        "$GUIDELLM_VENV/bin/pip" install guidellm
    fi
fi

WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
    [[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

"$PYTHON" - "$WORK/tokenizer" <<'EOF'
import sys

from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.loader import load_tokenizer

load_tokenizer(default_model_path()).save_pretrained(sys.argv[1])
EOF

if [[ -z "${TARGET:-}" ]]; then
    PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
    "$PYTHON" -m kvserve.entrypoints.cli serve --port "$PORT" ${SERVE_ARGS:-} >"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    TARGET=http://127.0.0.1:$PORT
    for _ in $(seq 600); do
        curl -sf "$TARGET/health" >/dev/null && break
        kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.log"; exit 1; }
        sleep 0.5
    done
    curl -sf "$TARGET/health" >/dev/null || { echo "server not healthy after 300 s" >&2; exit 1; }
fi

"$GUIDELLM" run \
    --backend "kind=openai_http,target=$TARGET" \
    --profile "kind=concurrent,streams=$STREAMS" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --tokenizer "kind=huggingface_auto,model=$WORK/tokenizer" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --output "kind=json,path=$OUTPUT" \
    --disable-console-interactive
