"""Interleaved A/B of a mixed load's throughput, batch-invariant prompts cut at canonical
chunk boundaries against cut where the step budget ends, on one engine (the scheduler's
chunking is switched between runs; the layers stay batch-invariant in both): SmolLM2 Q4_1
under the CPU auto plan, the CPU step budget (512 tokens: chunks of 256), eager steps, no
prefix caching (each run computes every prompt). The load: `streams` short prompts decoding
64 tokens each beside `long` prompts of 700 tokens that generate 16, all submitted at once
(streams 0: a prefill-only load). Prints total (prompt + output) tok/s and the long prompts'
mean time to first token.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/batch-invariance/ab_prefill_chunks.py 8 4 3
"""

from __future__ import annotations

import statistics
import sys
import time

from kvserve import LLM, SamplingParams

streams, long, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM(quantization="auto", batch_invariant=True, max_num_batched_tokens=None, enable_prefix_caching=False)
scheduler = llm.engine.core.scheduler
canonical = scheduler.canonical
assert canonical is not None
tokenizer = llm.get_tokenizer()
story = "The keeper climbed the stairs of the lighthouse each evening to light the lamp for the ships. "
long_ids = [tokenizer.encode(f"Log {i}. " + story * 40)[:700] for i in range(long)]
prompts = [f"Story number {i}: once upon a time" for i in range(streams)] + [{"prompt_token_ids": ids} for ids in long_ids]
params = ([SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)] * streams
          + [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * long)
llm.generate(prompts, params)  # warm-up
rates: dict[bool, list[float]] = {True: [], False: []}
for _ in range(rounds):
    for canonical_chunks in (False, True):
        scheduler.canonical = canonical if canonical_chunks else None
        steps = 0

        def count_step() -> None:
            global steps
            steps += 1

        start = time.perf_counter()
        outputs = llm.generate(prompts, params, on_step=count_step)
        seconds = time.perf_counter() - start
        total = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
        rates[canonical_chunks].append(total / seconds)
        ttft = statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs[streams:])
        print(f"canonical_chunks={canonical_chunks}: {total / seconds:.1f} tok/s total ({seconds:.2f} s, "
              f"{steps} steps), long prompts' mean TTFT {ttft:.2f} s", flush=True)
for canonical_chunks in (False, True):
    print(f"canonical_chunks={canonical_chunks}: median {statistics.median(rates[canonical_chunks]):.1f} tok/s, "
          f"best {max(rates[canonical_chunks]):.1f} over {rounds} runs")
