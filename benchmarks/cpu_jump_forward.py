"""Jump-forward for structured outputs on the CPU: SmolLM2 (the default model and settings)
with speculative_config {"method": "jump_forward"} beside the same engine without it, each
stream greedy and constrained to a JSON schema with long fixed keys, the two engines
interleaved in one process. Reports output tok/s, engine steps, draft acceptance, and
whether the outputs are identical (they must be: drafts are verified).

    PYTHONPATH=. python benchmarks/cpu_jump_forward.py [--streams 1] [--rounds 3] [--k 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.structured_output.params import StructuredOutputsParams


def long_keys_schema(index: int) -> dict:
    """An order whose keys are most of its text (distinct per stream)."""
    text = {"type": "string", "maxLength": 10}
    properties = {
        f"customer_full_name_{index}": text, "shipping_address_first_line": text,
        "preferred_delivery_time_window": {"enum": ["morning", "afternoon", "evening"]},
        "number_of_items_in_the_order": {"type": "integer", "minimum": 1, "maximum": 9},
        "gift_wrapping_was_requested": {"type": "boolean"},
        "customer_loyalty_program_tier": {"enum": ["bronze", "silver", "gold"]},
    }
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1, help="Concurrent requests (default: 1).")
    parser.add_argument("--rounds", type=int, default=3, help="Timed runs of each engine (default: 3).")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens: the longest jump (default: 8).")
    parser.add_argument("--compact", action="store_true",
                        help="disable_any_whitespace: compact JSON, longer forced runs.")
    args = parser.parse_args()

    plain = LLM(max_num_seqs=args.streams)
    jumping = LLM(max_num_seqs=args.streams, speculative_config={
        "method": "jump_forward", "num_speculative_tokens": args.k,
        "disable_by_batch_size": max(args.streams, 1)})
    prompts = [f"Order {i} as JSON:" for i in range(args.streams)]
    params = [SamplingParams(temperature=0.0, max_tokens=192, structured_outputs=StructuredOutputsParams(
        json=long_keys_schema(i), disable_any_whitespace=args.compact)) for i in range(args.streams)]

    def run(llm: LLM) -> tuple[float, int, int, list[list[int]]]:
        steps = llm.engine.core.num_steps
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return elapsed, sum(map(len, tokens)), llm.engine.core.num_steps - steps, tokens

    run(plain), run(jumping)  # warm-up, grammars compiled
    results: dict[str, list[tuple[float, int, int]]] = {"plain": [], "jump_forward": []}
    identical = True
    for round_index in range(args.rounds):
        order = [("plain", plain), ("jump_forward", jumping)]
        outputs = {}
        for name, llm in order if round_index % 2 == 0 else order[::-1]:
            elapsed, tokens, steps, outputs[name] = run(llm)
            results[name].append((elapsed, tokens, steps))
        identical &= outputs["plain"] == outputs["jump_forward"]
    for name, runs in results.items():
        seconds = [elapsed for elapsed, _, _ in runs]
        tokens, steps = runs[0][1], runs[0][2]
        print(f"{name:12s} {tokens / statistics.median(seconds):6.1f} output tok/s (median of "
              + ", ".join(f"{s:.2f}" for s in seconds) + f" s), {tokens} tokens in {steps} steps")
    stats = jumping.engine.spec_decode_stats
    speedup = (statistics.median(e for e, _, _ in results["plain"])
               / statistics.median(e for e, _, _ in results["jump_forward"]))
    print(f"jump_forward / plain: {speedup:.3f}x; drafts accepted {stats.num_accepted_tokens} of "
          f"{stats.num_draft_tokens} ({100 * stats.acceptance_rate:.0f}%); outputs identical: {identical}")


if __name__ == "__main__":
    main()
