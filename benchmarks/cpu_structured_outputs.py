"""Output tok/s of SmolLM2 on the CPU with every stream constrained to a JSON schema of its
own, beside the same load unconstrained, interleaved in one process; and the compile time of
each new schema's grammar.

Each constrained stream's schema asks for more objects than fit in --max-tokens, so both
runs generate exactly streams x max-tokens tokens (the unconstrained one with ignore_eos).

    PYTHONPATH=. python benchmarks/cpu_structured_outputs.py [--streams 16] [--max-tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.structured_output.params import StructuredOutputsParams


def schema(index: int) -> dict:
    """A distinct schema per stream: an array of objects that never ends within the budget."""
    item = {"type": "object", "additionalProperties": False, "required": [f"name_{index}", "age"],
            "properties": {f"name_{index}": {"type": "string", "maxLength": 8},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    return {"type": "array", "items": item, "minItems": 200}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16, help="Concurrent requests (default: 16).")
    parser.add_argument("--max-tokens", type=int, default=128, help="Tokens per stream (default: 128).")
    parser.add_argument("--runs", type=int, default=3, help="Timed runs of each load (default: 3).")
    args = parser.parse_args()

    llm = LLM(kv_cache_memory="512MiB", max_num_seqs=args.streams)
    prompts = [f"People as JSON, list {i}:" for i in range(args.streams)]
    plain = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True)
    grammars = llm.engine.core.runner.step_sampler.grammars
    compile_s = []
    for i in range(args.streams):  # compiled up front: the timed runs measure the steps
        start = time.perf_counter()
        grammars.compiler.get(StructuredOutputsParams(json=schema(i)))
        compile_s.append(time.perf_counter() - start)
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
    compile_s.sort()
    print(f"grammar compile (s) over {len(compile_s)} schemas: p50 {statistics.median(compile_s):.4f}, "
          f"max {compile_s[-1]:.4f}")


if __name__ == "__main__":
    main()
