"""W5 on the low-repetition prompts, batch 1, greedy: plain decoding and several speculative
configurations on the same weights in one process, each prompt run by every configuration
back to back (the order rotating), so a shared machine's load falls on all alike.

    python benchmarks/results/cpu-w5-learned/measure.py --heads HEADS_DIR --output-len 64
    python benchmarks/results/cpu-w5-learned/measure.py --eagle EAGLE_DIR --only "eagle chain 3"
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvserve.benchmarks.spec_decode import LOW_REPETITION_PROMPTS, _prompt
from kvserve.engine.core import load_engine_model
from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def configs(heads: str | None, eagle: str | None) -> dict[str, dict | None]:
    chosen = {
        "plain": None,
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "medusa chain 3": {"method": "medusa", "model": heads, "num_speculative_tokens": 3},
        "medusa chain 2": {"method": "medusa", "model": heads, "num_speculative_tokens": 2},
        "medusa tree 5": {"method": "medusa", "model": heads, "num_speculative_tokens": 5,
                          "speculative_token_tree": "[(0,), (0, 0), (0, 0, 0), (1,), (0, 1)]"},
        "eagle chain 3": {"method": "eagle", "model": eagle, "num_speculative_tokens": 3},
        "eagle chain 2": {"method": "eagle", "model": eagle, "num_speculative_tokens": 2},
    }
    return {name: c for name, c in chosen.items()
            if c is None or c.get("method") not in ("medusa", "eagle") or c["model"] is not None}


def counters(llm: LLM) -> tuple[int, int, int, list[int]]:
    """(verify runs, drafted, accepted, accepted per position) so far; zeros without speculation."""
    stats = llm.engine.spec_decode_stats
    if stats is None:
        return 0, 0, 0, []
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", help="Medusa heads from train-drafter --method medusa")
    parser.add_argument("--eagle", help="an EAGLE head from train-drafter --method eagle")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--only", nargs="*", help="configuration names to run besides plain")
    parser.add_argument("--num-prompts", type=int, default=len(LOW_REPETITION_PROMPTS),
                        help="the first N low-repetition prompts")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    loaded = load_engine_model(EngineArgs())
    chosen = {name: c for name, c in configs(args.heads, args.eagle).items() if name == "plain" or not args.only or name in args.only}
    engines = {name: LLM(loaded=loaded, speculative_config=c) for name, c in chosen.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    for llm in engines.values():
        llm.generate(_prompt(llm, "Hello"), SamplingParams(temperature=0.0, max_tokens=8))
    names = list(engines)
    seconds = dict.fromkeys(names, 0.0)
    outputs = {name: [] for name in names}
    before = {name: counters(e) for name, e in engines.items()}
    load_start = os.getloadavg()
    for i, text in enumerate(LOW_REPETITION_PROMPTS[: args.num_prompts]):
        for name in names[i % len(names):] + names[: i % len(names)]:
            llm = engines[name]
            start = time.perf_counter()
            out = llm.generate(_prompt(llm, text), params)[0]
            seconds[name] += time.perf_counter() - start
            outputs[name].append(list(out.outputs[0].token_ids))
        print(f"prompt {i}: " + ", ".join(f"{n} {seconds[n]:.1f}s" for n in names), flush=True)
    results = {}
    for name in names:
        after = counters(engines[name])
        drafts, drafted, accepted = (a - b for a, b in zip(after[:3], before[name][:3]))
        per_position = [a - b for a, b in zip(after[3], before[name][3] + [0] * 16)]
        tokens = sum(len(o) for o in outputs[name])
        results[name] = {
            "tokens": tokens, "tok_s": tokens / seconds[name], "speedup": seconds["plain"] / seconds[name],
            "acceptance": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "accepted_per_position_per_step": [a / drafts for a in per_position] if drafts else [],
            "identical": outputs[name] == outputs["plain"],
        }
    load = {"start": load_start, "end": os.getloadavg()}
    print(f"load average at start {load['start']}, end {load['end']}")
    print(f"{'config':>15s} {'tokens':>7s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'mean len':>9s} identical  per-position")
    for name, r in results.items():
        print(f"{name:>15s} {r['tokens']:7d} {r['tok_s']:7.1f} {r['speedup']:7.2f}x {r['acceptance']:7.1%} "
              f"{r['mean_accepted_length']:9.2f} {str(r['identical']):>9s}  "
              + " ".join(f"{a:.2f}" for a in r["accepted_per_position_per_step"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"configs": chosen, "output_len": args.output_len, "load_average": load, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
