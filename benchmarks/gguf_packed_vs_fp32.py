"""fp32 (dequantized) vs quantization='gguf' (packed blocks) on the embedded SmolLM2: decode
ms per step at batch 1 and 16 (prompt 64, 48 new tokens, greedy), rounds interleaved so
both paths see the same machine load; medians over rounds.

Usage: python benchmarks/gguf_packed_vs_fp32.py [threads] [rounds]
"""

import os
import statistics
import sys

import torch

from kvserve import LLM
from kvserve.benchmarks.latency import run_latency
from kvserve.model_executor.loader import load_model


def main(threads: int, rounds: int) -> None:
    torch.set_num_threads(threads)
    llms = {
        name: LLM(loaded=load_model(None, quantization=method), kv_cache_memory="256MiB",
                  enable_prefix_caching=False)
        for name, method in (("fp32", None), ("gguf", "gguf"))
    }
    steps: dict[tuple[str, int], list[float]] = {(name, b): [] for name in llms for b in (1, 16)}
    for seed in range(rounds):
        for batch in (1, 16):
            for name, llm in llms.items():
                ms = run_latency(llm, batch, 64, 48, bandwidth=12e9, seed=seed).tpot_ms_median
                steps[(name, batch)].append(ms)
                print(f"round {seed} {name} batch {batch}: {ms:.1f} ms/step, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    for batch in (1, 16):
        fp32, packed = (statistics.median(steps[(name, batch)]) for name in ("fp32", "gguf"))
        print(f"threads {threads} batch {batch}: fp32 {fp32:.1f} ms/step, gguf packed "
              f"{packed:.1f} ms/step, packed/fp32 time {packed / fp32:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads(),
         int(sys.argv[2]) if len(sys.argv) > 2 else 3)
