"""`kvserve bench spec-decode` (W5): batch 1, greedy, one prompt at a time, with and without
speculative decoding on the same weights. Two prompt sets: ten that ask to repeat or edit
a given paragraph or function (where prompt lookup pays) and ten open questions with
little repetition (where speculation must not cost). Reports output tok/s of each, the
speedup, acceptance rate and mean accepted length, and whether outputs are identical.
Each prompt runs with and without speculation back to back, so a shared machine's load
falls on both alike; `--repeats` runs the sets again and reports each set's median."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict, dataclass

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.core import load_engine_model
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

DEFAULT_SPECULATIVE_CONFIG = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
}

_TEXTS = [
    "The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed "
    "its one hundred and twelve steps, wound the clockwork, lit the lamp and wrote the weather "
    "in a leather book. Ships passing in the night saw the beam turn once every ten seconds.",
    "Our team meets every Monday at nine. Please bring a short summary of what you finished last "
    "week, what you plan to do this week, and anything that blocks you. The meeting ends at half "
    "past nine so that everyone can get back to work.",
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n",
    "def find_user(users, name):\n    for user in users:\n        if user['name'] == name:\n"
    "            return user\n    return None\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n        return self.count\n",
]
_EDITS = [
    "Rewrite the paragraph, replacing 'keeper' with 'guardian'. Keep everything else the same.",
    "Rewrite the paragraph, replacing 'Monday' with 'Tuesday'. Keep everything else the same.",
    "Rename the variable 'total' to 'running_sum' and output the complete function.",
    "Add a docstring to the function and output the complete function.",
    "Rename the method 'increment' to 'add_one' and output the complete class.",
]
REPEAT_EDIT_PROMPTS = [
    f"Repeat the following text exactly, without any changes:\n\n{text}" for text in _TEXTS
] + [f"{edit}\n\n{text}" for text, edit in zip(_TEXTS, _EDITS)]
LOW_REPETITION_PROMPTS = [
    "Write a short story about a dragon who learns to cook.",
    "Explain how vaccines train the immune system.",
    "What are three good habits for studying a new language?",
    "Describe the water cycle to a ten-year-old.",
    "Give me ideas for a rainy Sunday afternoon.",
    "Why do cats purr? Answer in a few sentences.",
    "Compare trains and planes for a 500 km trip.",
    "Write a limerick about a forgetful robot.",
    "What should I pack for a weekend of hiking?",
    "Explain what a database index is and why it helps.",
]


@dataclass
class SetResult:
    name: str
    num_prompts: int
    output_tokens: int
    plain_tok_s: float
    spec_tok_s: float
    speedup: float
    acceptance_rate: float
    mean_accepted_length: float
    identical_outputs: bool


def _prompt(llm: LLM, text: str) -> dict:
    tokenizer = llm.get_tokenizer()
    if tokenizer is not None and tokenizer.chat_template:
        return {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": text}])}
    return {"prompt": text}


def _timed_output(llm: LLM, prompt: dict, params: SamplingParams) -> tuple[list[int], float]:
    start = time.perf_counter()
    output = llm.generate(prompt, params)[0]
    return list(output.outputs[0].token_ids), time.perf_counter() - start


def run_set(name: str, texts: list[str], plain: LLM, spec: LLM, params: SamplingParams) -> SetResult:
    """Batch 1: each prompt runs alone, with and without speculation back to back (the
    order alternating), so load from elsewhere on the machine falls on both alike."""
    prompts = [_prompt(plain, t) for t in texts]
    stats = spec.engine.spec_decode_stats
    before = dataclasses.replace(stats, accepted_per_position=list(stats.accepted_per_position))
    plain_outputs, spec_outputs, plain_s, spec_s = [], [], 0.0, 0.0
    for i, prompt in enumerate(prompts):
        order = ((plain, plain_outputs), (spec, spec_outputs))
        for llm, outputs in order if i % 2 == 0 else order[::-1]:
            tokens, seconds = _timed_output(llm, prompt, params)
            outputs.append(tokens)
            if llm is plain:
                plain_s += seconds
            else:
                spec_s += seconds
    drafts = stats.num_drafts - before.num_drafts
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    num_tokens = sum(len(o) for o in plain_outputs)
    return SetResult(
        name, len(texts), num_tokens, num_tokens / plain_s,
        sum(len(o) for o in spec_outputs) / spec_s, plain_s / spec_s,
        accepted / drafted if drafted else 0.0, 1 + accepted / drafts if drafts else 0.0,
        spec_outputs == plain_outputs,
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--output-len", type=int, default=128,
                       help="Most output tokens per prompt (greedy; EOS ends earlier).")
    group.add_argument("--output-json", default=None, help="Write the results to this file.")
    group.add_argument("--repeats", type=int, default=1,
                       help="Run each prompt set this many times; report the run of median speedup.")


def run_from_args(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    spec_config = engine_args.speculative_config or DEFAULT_SPECULATIVE_CONFIG
    loaded = load_engine_model(engine_args)
    base = {k: v for k, v in vars(engine_args).items() if k not in ("model", "speculative_config")}
    plain = LLM(loaded=loaded, **base)
    spec = LLM(loaded=loaded, speculative_config=spec_config, **base)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    warmup = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in (plain, spec):
        llm.generate(_prompt(llm, REPEAT_EDIT_PROMPTS[0]), warmup)
    results = []
    for name, texts in (("repeat-edit", REPEAT_EDIT_PROMPTS), ("low-repetition", LOW_REPETITION_PROMPTS)):
        runs = sorted((run_set(name, texts, plain, spec, params) for _ in range(args.repeats)),
                      key=lambda r: r.speedup)
        results.append(runs[len(runs) // 2])
    print(f"\nspeculative_config: {json.dumps(spec_config)}")
    print(f"{'set':>15s} {'tokens':>7s} {'plain tok/s':>12s} {'spec tok/s':>11s} {'speedup':>8s} "
          f"{'accept':>7s} {'mean len':>9s} {'identical':>10s}")
    for r in results:
        print(f"{r.name:>15s} {r.output_tokens:7d} {r.plain_tok_s:12.1f} {r.spec_tok_s:11.1f} "
              f"{r.speedup:7.2f}x {r.acceptance_rate:7.1%} {r.mean_accepted_length:9.2f} "
              f"{str(r.identical_outputs):>10s}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"speculative_config": spec_config,
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 0
