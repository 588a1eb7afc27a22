"""`kvserve` command line: generate, chat, serve, bench, eval."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.engine.engine_args import EngineArgs


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
    from kvserve.llm import LLM

    params = sampling_params_from_args(args)  # bad flags fail before the model loads
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    for output in llm.generate(args.prompts, params):
        for completion in output.outputs:
            prefix = f"[{output.request_id}.{completion.index}] " if params.n > 1 or len(args.prompts) > 1 else ""
            print(f"{prefix}{(output.prompt or '')}{completion.text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.chat import run_chat

    return run_chat(EngineArgs.from_cli_args(args), sampling_params_from_args(args), args.system)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.server import run_server

    return run_server(args)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.throughput import run_from_args

    return run_from_args(args)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.latency import run_from_args

    return run_from_args(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.serve import run_from_args

    return run_from_args(args)


def cmd_eval_perplexity(args: argparse.Namespace) -> int:
    from kvserve.eval.perplexity import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="LLM inference engine with a paged KV cache."
    )
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

    bench = commands.add_parser("bench", help="Benchmarks.")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    from kvserve.benchmarks.throughput import add_cli_args as add_throughput_args

    throughput = bench_commands.add_parser(
        "throughput", help="Offline throughput: batched vs one-at-a-time (and transformers)."
    )
    EngineArgs.add_cli_args(throughput)
    add_throughput_args(throughput)
    throughput.set_defaults(handler=cmd_bench_throughput)
    from kvserve.benchmarks.latency import add_cli_args as add_latency_args

    latency = bench_commands.add_parser(
        "latency", help="W2: TTFT and time per output token at fixed batch sizes, vs the floor."
    )
    EngineArgs.add_cli_args(latency)
    add_latency_args(latency)
    latency.set_defaults(handler=cmd_bench_latency)
    from kvserve.benchmarks.serve import add_cli_args as add_serve_bench_args

    serve_bench = bench_commands.add_parser(
        "serve", help="Online serving load test against any OpenAI-compatible server."
    )
    add_serve_bench_args(serve_bench)
    serve_bench.set_defaults(handler=cmd_bench_serve)

    evaluate = commands.add_parser("eval", help="Quality evaluations.")
    eval_commands = evaluate.add_subparsers(dest="eval_command", required=True)
    from kvserve.eval.perplexity import add_cli_args as add_perplexity_args

    perplexity = eval_commands.add_parser(
        "perplexity", help="Sliding-window perplexity of a text file through the engine."
    )
    EngineArgs.add_cli_args(perplexity)
    add_perplexity_args(perplexity)
    perplexity.set_defaults(handler=cmd_eval_perplexity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"kvserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
