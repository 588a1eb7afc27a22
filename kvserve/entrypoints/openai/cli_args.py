"""`kvserve serve` flags; kept free of server imports so building the CLI parser stays light."""

from __future__ import annotations

import argparse

from kvserve import envs
from kvserve.engine.engine_args import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--served-model-name", default=None,
        help="Model name clients send and see (default: the model file or directory name).",
    )
    group.add_argument(
        "--api-key", default=envs.KVSERVE_API_KEY,
        help="Require 'Authorization: Bearer KEY' on /v1 and tokenizer endpoints "
        "(default: $KVSERVE_API_KEY; unset means no key).",
    )
    group.add_argument(
        "--max-waiting-requests", type=int, default=None,
        help="Answer 429 when this many requests already wait for the engine (default: no limit).",
    )
    group.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="On SIGTERM, seconds to let in-flight requests finish before exiting.",
    )
    group.add_argument(
        "--stream-interval", type=int, default=1,
        help="Tokens per streamed chunk; larger values cut SSE overhead at high concurrency.",
    )
    EngineArgs.add_cli_args(parser)
    # Serving picks per-device settings unless told otherwise (logged at startup).
    parser.set_defaults(quantization="auto", max_num_batched_tokens=None, compile_decode=None)
