"""Interleaved A/B of decode throughput, batch-invariant plan against the per-batch-size one,
on one loaded model (the flag is toggled on its layers between runs): SmolLM2 Q4_1 under the
CPU auto plan, N greedy streams of 64 tokens (or argv[3]) (ignore_eos), eager steps.

    PYTHONPATH=. python benchmarks/results/batch-invariance/ab_decode.py 16 4
"""

from __future__ import annotations

import statistics
import sys
import time

from kvserve import LLM, SamplingParams
from kvserve.quantization.base import QuantizedLinear

streams, rounds = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(quantization="auto", batch_invariant=True, max_num_batched_tokens=None)
runner = llm.engine.core.runner
layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
prompts = [f"Story number {i}: once upon a time" for i in range(streams)]
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]) if len(sys.argv) > 3 else 64, ignore_eos=True)
llm.generate(prompts, params)  # warm-up
rates: dict[bool, list[float]] = {True: [], False: []}
for _ in range(rounds):
    for invariant in (False, True):
        runner.batch_invariant = invariant
        for layer in layers:
            layer.batch_invariant = invariant
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates[invariant].append(tokens / seconds)
        print(f"batch_invariant={invariant}: {tokens / seconds:.1f} tok/s ({seconds:.2f} s)", flush=True)
for invariant in (False, True):
    print(f"batch_invariant={invariant}: median {statistics.median(rates[invariant]):.1f} tok/s, "
          f"best {max(rates[invariant]):.1f} over {rounds} runs")
