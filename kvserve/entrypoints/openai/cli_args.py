"""`kvserve serve` flags; kept free of server imports so building the CLI parser stays light."""

from __future__ import annotations

import argparse

from collections.abc import Callable

from kvserve import envs
from kvserve.engine.engine_args import EngineArgs
from kvserve.entrypoints.openai.lora_modules import parse_lora_module
from kvserve.utils import parse_size


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


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
        "--max-n", type=_positive(int), default=128,
        help="Most samples (n) one request may ask for (default: 128, OpenAI's limit); "
        "never more than --max-num-seqs.",
    )
    group.add_argument(
        "--request-timeout", type=_positive(float), default=None,
        help="End a generation request that has not finished this many seconds after it was "
        "admitted (queue time included) with a 504 and free its KV blocks (default: no limit).",
    )
    group.add_argument(
        "--max-body-size", type=parse_size, default="16MiB",
        help="Largest request body accepted, e.g. 16MiB; larger ones get 413.",
    )
    group.add_argument(
        "--header-read-timeout", type=_positive(float), default=20.0,
        help="Seconds a connection may take to send a request's headers (counted from when it "
        "opens or its previous response ends) before it is closed; keep it above clients' "
        "idle-connection expiry (httpx: 5 s).",
    )
    group.add_argument(
        "--body-read-timeout", type=_positive(float), default=60.0,
        help="Seconds a request's body may take to arrive after its headers; then 408.",
    )
    group.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="On SIGTERM, seconds to let in-flight requests finish before exiting.",
    )
    group.add_argument(
        "--health-stall-timeout", type=_positive(float), default=300.0,
        help="/health answers 503 once requests are in flight and the engine has made no progress "
        "(no step finished) for this many seconds; keep it above the longest step (default: 300).",
    )
    group.add_argument(
        "--stream-interval", type=int, default=1,
        help="Tokens per streamed chunk; larger values cut SSE overhead at high concurrency.",
    )
    group.add_argument(
        "--tool-call-parser", choices=["hermes", "llama3_json", "mistral", "qwen25"], default=None,
        help='How tool calls are read from the model\'s text for tool_choice "auto" (default: '
        'none, and "auto" is refused; "required" and named functions work without one).',
    )
    group.add_argument(
        "--lora-modules", nargs="+", type=parse_lora_module, default=[], metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve, each as name=path or as JSON "
        '\'{"name": "sql-lora", "path": "/adapters/sql", "base_model_name": "..."}\'; a request '
        'selects one with "model": "<name>", and /v1/models lists each with the base model as '
        "its parent. Needs --enable-lora.",
    )
    group.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="Accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter ({\"lora_name\", "
        "\"lora_path\"}, behind --api-key) to add and remove adapters while serving.",
    )
    group.add_argument(
        "--no-dashboard", dest="dashboard", action="store_false",
        help="Do not serve the live dashboard (/dashboard: KV block map, queues, batch timeline, "
        "latency charts; behind --api-key when one is set). It costs nothing while no page is open.",
    )
    EngineArgs.add_cli_args(parser)
    # Serving picks per-device settings unless told otherwise (logged at startup).
    parser.set_defaults(quantization="auto", max_num_batched_tokens=None, compile_decode=None,
                        batch_invariant=None)
