"""`kvserve` command line: generate, chat, serve, plan, cost, bench, eval."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvserve.logger import configure_logging

# This module imports nothing that loads torch: main() sets GOMP_SPINCOUNT first (see there),
# and the engine's modules load when the parser is built or a command runs.


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help text ending in the flag's default value, unless the text already says what the
    default is or there is none to show (None, a store_true flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or "default" in help.lower()):
            return help
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default))
        # help is a %-format string: a literal % in the default must survive it.
        return f"{help} (default: {str(default).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; its subcommands' parsers are of this class
    too (add_subparsers builds them with the parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpWithDefaults)
        super().__init__(*args, **kwargs)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, help="Most tokens to generate.")
    group.add_argument(
        "--temperature", type=float, default=0.7, help="Sampling temperature; 0 is greedy."
    )
    group.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass in (0, 1].")
    group.add_argument("--top-k", type=int, default=-1, help="Keep the k most likely tokens; -1 keeps all.")
    group.add_argument("--min-p", type=float, default=0.0, help="Drop tokens below min_p x the top probability.")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style repetition penalty (> 0; 1 is off).")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty in [-2, 2].")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty in [-2, 2].")
    group.add_argument(
        "--sampling-seed", type=int, default=None, help="Sampling seed for reproducible output."
    )
    group.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    group.add_argument("--min-tokens", type=int, default=0, help="Generate at least this many tokens before EOS may stop.")
    group.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")
    group.add_argument("-n", "--n", type=int, default=1, help="Number of samples per prompt.")


def sampling_params_from_args(args: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop, min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, max_tokens=args.max_tokens,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine_args import EngineArgs
    from kvserve.llm import LLM

    params = sampling_params_from_args(args)  # bad flags fail before the model loads
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    for output in llm.generate(args.prompts, params):
        for completion in output.outputs:
            prefix = f"[{output.request_id}.{completion.index}] " if params.n > 1 or len(args.prompts) > 1 else ""
            print(f"{prefix}{(output.prompt or '')}{completion.text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvserve.engine.engine_args import EngineArgs
    from kvserve.entrypoints.chat import run_chat

    return run_chat(EngineArgs.from_cli_args(args), sampling_params_from_args(args), args.system)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.server import run_server

    return run_server(args)


def cmd_router(args: argparse.Namespace) -> int:
    from kvserve.router.main import run_router

    return run_router(args)


# Benchmark and evaluation tools: each module has add_cli_args(parser) and run_from_args(args).
# (group, command, help, module, whether it loads an engine and so takes the engine flags)
_TOOLS = [
    ("bench", "throughput", "Offline throughput: batched vs one-at-a-time (and transformers).",
     "kvserve.benchmarks.throughput", True),
    ("bench", "latency", "W2: TTFT and time per output token at fixed batch sizes, vs the floor.",
     "kvserve.benchmarks.latency", True),
    ("bench", "quantized-linears", "Device time of llama3-8b's linears per weight format (GPU), vs the floor.",
     "kvserve.benchmarks.quantized_linears", False),
    ("bench", "spec-decode", "W5: batch-1 greedy tok/s with and without speculative decoding.",
     "kvserve.benchmarks.spec_decode", True),
    ("bench", "prefix", "W4: shared-prefix TTFT and throughput with the prefix cache on and off.",
     "kvserve.benchmarks.shared_prefix", True),
    ("bench", "serve", "Online serving load test against any OpenAI-compatible server.",
     "kvserve.benchmarks.serve", False),
    ("bench", "cpu-compare", "CPU serving side by side with llama.cpp's llama-server on the same GGUF.",
     "kvserve.benchmarks.cpu_compare", False),
    ("eval", "perplexity", "Sliding-window perplexity of a text file through the engine.",
     "kvserve.eval.perplexity", True),
]
# Commands of their own that load an engine: (command, help, module).
_ENGINE_COMMANDS = [
    ("train-drafter", "Train Medusa heads or an EAGLE head for a model by self-distillation on a text; "
                      "prints held-out acceptance.",
     "kvserve.spec_decode.train_drafter"),
]
_TOOL_GROUPS = {"bench": "Benchmarks.", "eval": "Quality evaluations."}
# Commands that size and price a deployment without loading a model: (command, help, module).
_PLANNERS = [
    ("plan", "Capacity plan: weights, KV blocks, concurrent sequences and floors of a model on a device.",
     "kvserve.planning.plan_cli"),
    ("cost", "Serving cost per million tokens from a `kvserve bench serve` or `bench throughput` JSON.",
     "kvserve.planning.cost_cli"),
]


_ROUTER_HELP = "One OpenAI endpoint in front of many serve replicas: cache-aware routing, failover."


def _add_router_parser(commands) -> argparse.ArgumentParser:
    from kvserve.router.cli_args import add_cli_args as add_router_args

    router = commands.add_parser("router", help=_ROUTER_HELP, description=_ROUTER_HELP)
    add_router_args(router)
    router.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="After `--`: the `kvserve serve` arguments of --launch replicas.")
    router.set_defaults(handler=cmd_router)
    return router


def _build_router_only_parser() -> argparse.ArgumentParser:
    """`kvserve router` without loading the engine's modules (torch among them) to build the
    other commands' flags: the router starts in a moment."""
    parser = _Parser(prog="kvserve", description="LLM inference engine with a paged KV cache.")
    parser.add_argument("--log-level", default="INFO", help="Logging level (DEBUG, INFO, WARNING).")
    _add_router_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def build_parser() -> argparse.ArgumentParser:
    from kvserve.engine.engine_args import EngineArgs

    parser = _Parser(prog="kvserve", description="LLM inference engine with a paged KV cache.")
    parser.add_argument("--log-level", default="INFO", help="Logging level (DEBUG, INFO, WARNING).")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="Complete one or more prompts and print the text.")
    generate.add_argument("prompts", nargs="+", help="Prompt text(s).")
    EngineArgs.add_cli_args(generate)
    add_sampling_args(generate)
    generate.set_defaults(handler=cmd_generate)

    chat = commands.add_parser("chat", help="Interactive chat with streaming replies.")
    chat.add_argument("--system", default=None, help="System prompt.")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(handler=cmd_chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server with streaming and metrics.")
    from kvserve.entrypoints.openai.cli_args import add_cli_args as add_serve_args

    add_serve_args(serve)
    serve.set_defaults(handler=cmd_serve)

    for name, help, module_name in _PLANNERS:
        module = importlib.import_module(module_name)
        planner = commands.add_parser(name, help=help)
        module.add_cli_args(planner)
        planner.set_defaults(handler=module.run_from_args)
    _add_router_parser(commands)
    for name, help, module_name in _ENGINE_COMMANDS:
        module = importlib.import_module(module_name)
        command = commands.add_parser(name, help=help)
        EngineArgs.add_cli_args(command)
        module.add_cli_args(command)
        command.set_defaults(handler=module.run_from_args)

    groups = {
        name: commands.add_parser(name, help=help).add_subparsers(
            dest=f"{name}_command", required=True
        )
        for name, help in _TOOL_GROUPS.items()
    }
    for group, name, help, module_name, takes_engine_flags in _TOOLS:
        module = importlib.import_module(module_name)
        tool = groups[group].add_parser(name, help=help)
        if takes_engine_flags:
            EngineArgs.add_cli_args(tool)
        module.add_cli_args(tool)
        tool.set_defaults(handler=module.run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    # libgomp (torch's CPU thread pool) lets its workers spin only briefly between parallel
    # regions once it manages more threads than there are cores, as it does as soon as a thread
    # other than the main one (the engine's) runs torch on a small machine: each of a CPU
    # step's ~1,000 regions then pays a sleep and a wake-up. A million spins keep the workers
    # awake across a step. libgomp reads the variable when torch loads it, so it is set here,
    # before anything imports torch; an explicit setting wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "1000000")
    words = sys.argv[1:] if argv is None else argv
    command = next((w for i, w in enumerate(words) if not w.startswith("-")
                    and (i == 0 or words[i - 1] != "--log-level")), None)
    parser = _build_router_only_parser() if command == "router" else build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level.upper())
    try:
        return args.handler(args)
    except (ValueError, OSError) as error:  # bad input, a file that cannot be read or written
        print(f"kvserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
