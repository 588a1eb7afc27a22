"""`kvserve bench prefix` (W4 shared-prefix): requests that share a long system prompt, each
followed by a question of its own, all submitted at once, run with the prefix cache on and
off on the same weights (one engine at a time). Defaults as BENCHMARKS.md ("W4: shared
prefix") defines W4: 64 requests, a 2,000-token shared prefix, 100-token questions, 128
output tokens, random token ids, greedy, ignore_eos. Reports TTFT percentiles, wall time,
output and total tok/s, the prompt tokens the cache served, and how many requests gave the
same tokens both ways."""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from kvserve.benchmarks.serve_metrics import summarize_ms
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.core import load_engine_model
from kvserve.llm import LLM
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


@dataclass
class PrefixRunResult:
    prefix_caching: bool
    num_requests: int
    wall_s: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    output_tok_s: float
    total_tok_s: float
    cached_prompt_tokens: int  # prompt tokens served from the cache, over all requests
    prompt_tokens: int


def shared_prefix_prompts(num_requests: int, prefix_len: int, question_len: int, vocab_size: int,
                          seed: int) -> list[list[int]]:
    """Token ids: one random prefix, then a random question per request (ids from 10 up, so
    that special tokens at the bottom of a vocabulary are left out)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(10, vocab_size) for _ in range(question_len)] for _ in range(num_requests)]


def run_prefix(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[PrefixRunResult, list[list[int]]]:
    """All prompts submitted at once; (the run's numbers, each request's output tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.time()
    outputs: list[RequestOutput] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = max(o.metrics.finished_time for o in outputs) - start
    ttft = summarize_ms([o.metrics.first_token_time - o.metrics.arrival_time for o in outputs])
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    result = PrefixRunResult(
        llm.engine.core.cache_config.enable_prefix_caching, len(prompts), wall, ttft["p50"], ttft["p90"], ttft["p99"],
        generated / wall, (generated + prompt_tokens) / wall,
        sum(o.num_cached_tokens for o in outputs), prompt_tokens,
    )
    return result, [list(o.outputs[0].token_ids) for o in outputs]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=64, help="Requests, all submitted at once.")
    group.add_argument("--prefix-len", type=int, default=2000, help="Tokens of the prompt every request shares.")
    group.add_argument("--question-len", type=int, default=100, help="Tokens after the prefix, each request its own.")
    group.add_argument("--output-len", type=int, default=128, help="Tokens generated per request (greedy, ignore_eos).")
    group.add_argument("--prompt-seed", type=int, default=0, help="Seed of the random prompt token ids.")
    group.add_argument("--output-json", default=None, help="Write the results to this file.")


def run_from_args(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    device = engine_args.resolved_device()
    loaded = load_engine_model(engine_args)
    base = {k: v for k, v in vars(engine_args).items() if k not in ("model", "enable_prefix_caching")}
    prompts = shared_prefix_prompts(args.num_requests, args.prefix_len, args.question_len,
                                    loaded.config.vocab_size, args.prompt_seed)
    results, tokens = [], []
    for caching in (True, False):
        # One engine at a time: each takes its KV cache from the memory the other gave back.
        llm = LLM(loaded=loaded, enable_prefix_caching=caching, **base)
        # Warm-up on ids the prompts never use (they start at 10): nothing of theirs is cached.
        llm.generate([{"prompt_token_ids": [5] * 16}], SamplingParams(max_tokens=4))
        result, outputs = run_prefix(llm, prompts, args.output_len)
        results.append(result)
        tokens.append(outputs)
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(*tokens, strict=True))
    print(f"\n{args.num_requests} requests: {args.prefix_len}-token shared prefix + {args.question_len}-token "
          f"questions, {args.output_len} output tokens")
    print(f"{'prefix cache':>12s} {'wall s':>8s} {'TTFT p50':>9s} {'p90':>8s} {'p99':>8s} {'out tok/s':>10s} "
          f"{'total tok/s':>12s} {'cached prompt tokens':>21s}")
    for r in results:
        print(f"{'on' if r.prefix_caching else 'off':>12s} {r.wall_s:8.2f} {r.ttft_ms_p50:9.1f} {r.ttft_ms_p90:8.1f} "
              f"{r.ttft_ms_p99:8.1f} {r.output_tok_s:10.1f} {r.total_tok_s:12.1f} "
              f"{r.cached_prompt_tokens:>10d} of {r.prompt_tokens:<9d}")
    print(f"speedup with the cache: {results[1].wall_s / results[0].wall_s:.2f}x wall time, "
          f"TTFT p50 {results[1].ttft_ms_p50 / results[0].ttft_ms_p50:.2f}x lower; "
          f"identical greedy outputs: {same} of {args.num_requests}")
    if engine_args.load_format == "dummy":
        # Every logit of a random model is a near-tie, and the two runs batch differently.
        print("(dummy weights: greedy outputs are not expected to match; compare them on a real model)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"workload": {k: getattr(args, k) for k in (
                "num_requests", "prefix_len", "question_len", "output_len", "prompt_seed")},
                "results": [asdict(r) for r in results], "identical_outputs": same}, f, indent=2)
    return 0
