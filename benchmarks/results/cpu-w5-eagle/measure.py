"""W5 on the low-repetition prompts, batch 1, greedy: plain decoding and an EAGLE head at
several draft lengths on the same weights in one process, each prompt run by every
configuration back to back (the order rotating), so a shared machine's load falls on all
alike. Besides tok/s and acceptance it splits each speculative engine's time into drafting
(the proposer: the head's catch-up and draft steps, the LM head's projections) and the rest
(verify steps, sampling, engine overhead).

    python benchmarks/results/cpu-w5-eagle/measure.py --eagle EAGLE_DIR --k 2 3 --output-len 64 \
        [--trees "[(0,), (1,), (2,)]"]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import time

from kvserve.benchmarks.spec_decode import LOW_REPETITION_PROMPTS, _prompt
from kvserve.engine.core import load_engine_model
from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def counters(llm: LLM) -> tuple[int, int, int, list[int]]:
    stats = llm.engine.spec_decode_stats
    if stats is None:
        return 0, 0, 0, []
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position)


def timed_proposer(llm: LLM) -> list[float]:
    """A one-element list accumulating the seconds the engine's proposer spends (propose and observe)."""
    spent = [0.0]
    speculator = getattr(llm.engine.core.runner, "speculator", None)
    if speculator is None:
        return spent
    proposer = speculator.proposer
    for name in ("propose", "observe"):
        method = getattr(proposer, name)

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        setattr(proposer, name, timed)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eagle", required=True, help="an EAGLE head from train-drafter --method eagle")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3], help="draft lengths to run")
    parser.add_argument("--trees", nargs="*", default=[],
                        help="token trees to run as well (speculative_token_tree), e.g. \"[(0,), (1,), (2,)]\"")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=len(LOW_REPETITION_PROMPTS))
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    loaded = load_engine_model(EngineArgs())
    chosen = {"plain": None}
    chosen.update({f"eagle k={k}": {"method": "eagle", "model": args.eagle, "num_speculative_tokens": k}
                   for k in args.k})
    for tree in args.trees:
        nodes = len(ast.literal_eval(tree))
        chosen[f"eagle tree {nodes}"] = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": nodes,
                                         "speculative_token_tree": tree}
    engines = {name: LLM(loaded=loaded, speculative_config=c) for name, c in chosen.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    for llm in engines.values():
        llm.generate(_prompt(llm, "Hello"), SamplingParams(temperature=0.0, max_tokens=8))
    drafting = {name: timed_proposer(e) for name, e in engines.items()}
    names = list(engines)
    seconds = dict.fromkeys(names, 0.0)
    outputs = {name: [] for name in names}
    before = {name: counters(e) for name, e in engines.items()}
    load_start = os.getloadavg()
    prompts = LOW_REPETITION_PROMPTS[: args.num_prompts] * args.rounds
    for i, text in enumerate(prompts):
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
            "tokens": tokens, "seconds": seconds[name], "tok_s": tokens / seconds[name],
            "speedup": seconds["plain"] / seconds[name],
            "acceptance": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "acceptance_per_position": [a / drafts for a in per_position] if drafts else [],
            "verify_steps": drafts, "drafting_seconds": drafting[name][0],
            "drafting_share": drafting[name][0] / seconds[name],
            "identical": outputs[name] == outputs["plain"],
        }
    load = {"start": load_start, "end": os.getloadavg()}
    print(f"load average at start {load['start']}, end {load['end']}")
    print(f"{'config':>13s} {'tokens':>7s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'mean len':>9s} "
          f"{'drafting':>9s} identical  per-position")
    for name, r in results.items():
        print(f"{name:>13s} {r['tokens']:7d} {r['tok_s']:7.1f} {r['speedup']:7.2f}x {r['acceptance']:7.1%} "
              f"{r['mean_accepted_length']:9.2f} {r['drafting_share']:9.1%} {str(r['identical']):>9s}  "
              + " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"configs": chosen, "output_len": args.output_len, "rounds": args.rounds,
                       "load_average": load, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
