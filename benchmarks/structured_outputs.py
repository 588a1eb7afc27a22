"""Output tok/s with every stream constrained to a JSON schema of its own, beside the same
load unconstrained, interleaved in one process (SmolLM2 on the CPU by default; a model shape
with random weights and a tokenizer directory for the GPU); and what a first request
with a new schema pays before its first constrained step: the schema's check in the front
(JSON schema to grammar) and the grammar's compile in the runner (its token tables), p50 and
p99 over the 30 schemas of the structured-output tests, each round on a cold compiler.

Each constrained stream's schema asks for more objects than fit in --max-tokens, so both
runs generate exactly streams x max-tokens tokens (the unconstrained one with ignore_eos).

    PYTHONPATH=. python benchmarks/structured_outputs.py [--streams 16] [--max-tokens 128] [--runs 3]
    PYTHONPATH=. python benchmarks/structured_outputs.py --compile-only [--compile-rounds 5]
    PYTHONPATH=. python benchmarks/structured_outputs.py --model-shape llama3-8b --tokenizer DIR --streams 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.structured_output import grammar
from kvserve.structured_output.compiler import GrammarCompiler
from kvserve.structured_output.params import StructuredOutputsParams
from tests.structured_output.schemas import SCHEMAS


def schema(index: int) -> dict:
    """A distinct schema per stream: an array of objects that never ends within the budget."""
    item = {"type": "object", "additionalProperties": False, "required": [f"name_{index}", "age"],
            "properties": {f"name_{index}": {"type": "string", "maxLength": 8},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    return {"type": "array", "items": item, "minItems": 200}


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def compile_times(llm: LLM, rounds: int) -> dict[str, list[float]]:
    """Seconds per schema to check it (front) and to compile its grammar (runner), each round
    with the front's cache cleared and a new compiler (xgrammar's own cache is off)."""
    runner_grammars = llm.engine.core.runner.step_sampler.grammars
    tokenizer, vocab_size = llm.engine.tokenizer, runner_grammars.vocab_size
    stop_token_ids = runner_grammars.compiler.tokenizer_info.stop_token_ids
    times: dict[str, list[float]] = {"check": [], "compile": []}
    for _ in range(rounds):
        grammar._build.cache_clear()
        compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        for schema_dict in SCHEMAS:
            params = StructuredOutputsParams(json=schema_dict)
            start = time.perf_counter()
            grammar.check(params)
            checked = time.perf_counter()
            compiler.get(params)
            times["check"].append(checked - start)
            times["compile"].append(time.perf_counter() - checked)
    return times


def report_compile_times(times: dict[str, list[float]], rounds: int) -> None:
    print(f"first request with a new schema, ms over {len(SCHEMAS)} schemas x {rounds} cold rounds:")
    for name, values in times.items():
        ms = [1000 * v for v in values]
        print(f"  {name:8s} p50 {percentile(ms, 0.5):7.2f}  p99 {percentile(ms, 0.99):7.2f}  "
              f"max {max(ms):7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16, help="Concurrent requests (default: 16).")
    parser.add_argument("--max-tokens", type=int, default=128, help="Tokens per stream (default: 128).")
    parser.add_argument("--runs", type=int, default=3, help="Timed runs of each load (default: 3).")
    parser.add_argument("--compile-rounds", type=int, default=5,
                        help="Cold rounds over the 30 schemas for the compile times (default: 5).")
    parser.add_argument("--compile-only", action="store_true",
                        help="Measure the compile times alone, not the throughput.")
    parser.add_argument("--model-shape", default=None,
                        help="Random weights in this model's shape instead of the default model "
                             "(e.g. llama3-8b on a GPU); needs --tokenizer.")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer directory or GGUF file for --model-shape (the grammars' vocabulary).")
    args = parser.parse_args()
    if (args.model_shape is None) != (args.tokenizer is None):
        parser.error("--model-shape and --tokenizer go together")

    if args.model_shape is None:
        llm = LLM(kv_cache_memory="512MiB", max_num_seqs=args.streams)
    else:
        llm = LLM(load_format="dummy", model_shape=args.model_shape, tokenizer=args.tokenizer,
                  max_num_seqs=args.streams)
    report_compile_times(compile_times(llm, args.compile_rounds), args.compile_rounds)
    if args.compile_only:
        return
    prompts = [f"People as JSON, list {i}:" for i in range(args.streams)]
    plain = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True)
    grammars = llm.engine.core.runner.step_sampler.grammars
    for i in range(args.streams):  # compiled up front: the timed runs measure the steps
        grammars.compiler.get(StructuredOutputsParams(json=schema(i)))
    constrained = [SamplingParams(temperature=0.7, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=schema(i)))
                   for i in range(args.streams)]

    def run(params) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert tokens == args.streams * args.max_tokens, tokens
        return tokens / elapsed

    run(plain)  # warm-up
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.runs):
        rates["unconstrained"].append(run(plain))
        rates["json_schema"].append(run(constrained))
    for name, values in rates.items():
        print(f"{name:14s} output tok/s: median {statistics.median(values):.1f} (runs: "
              + ", ".join(f"{v:.1f}" for v in values) + ")")
    ratio = statistics.median(rates["json_schema"]) / statistics.median(rates["unconstrained"])
    print(f"json_schema / unconstrained: {ratio:.3f}")


if __name__ == "__main__":
    main()
