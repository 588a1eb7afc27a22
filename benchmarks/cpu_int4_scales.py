"""CPU decode steps of `--quantization auto` on the embedded SmolLM2 (Q4_1: int4 g32 on
kvserve's kernel) with the layers' scales and minimums in fp16 (the default where fp16 holds
them exactly, as it does Q4_1's d and m) against fp32, two engines in one process with their
rounds interleaved (the machine is shared and noisy). The weights are the same values either
way, so the tokens must agree.

    python benchmarks/cpu_int4_scales.py --rounds 8 --batch-sizes 1,4
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
from kvserve.llm import LLM
from kvserve.quantization import int4


def load(fp16: bool) -> LLM:
    kept = int4.exact_in_fp16
    if not fp16:
        int4.exact_in_fp16 = lambda values: False  # Int4Linear compacts its scales when built
    try:
        return LLM(quantization="auto", compile_decode=True, enable_prefix_caching=False)
    finally:
        int4.exact_in_fp16 = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="Interleaved rounds of 64 greedy tokens per batch size.")
    parser.add_argument("--batch-sizes", default="1,4", help="Comma-separated decode batch sizes.")
    args = parser.parse_args()
    engines = {}
    for name, fp16 in (("fp16", True), ("fp32", False)):
        llm = load(fp16)
        scales = {module.scale.dtype for module in llm.engine.runner.model.modules()
                  if isinstance(module, int4.Int4Linear)}
        print(f"{name} engine: int4 layers' scale dtypes {sorted(str(d) for d in scales)}", flush=True)
        engines[name] = llm, DecodeStepTimer(llm)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ms: dict[str, list[float]] = {name: [] for name in engines}
        for round_index in range(args.rounds):
            tokens = {}
            for name in (list(engines) if round_index % 2 == 0 else list(engines)[::-1]):
                step_ms, tokens[name] = run_round(*engines[name], batch, 64, 64, seed=round_index)
                ms[name].append(step_ms)
            assert tokens["fp16"] == tokens["fp32"], "the two engines decoded different tokens"
        fp16_ms, fp32_ms = statistics.median(ms["fp16"]), statistics.median(ms["fp32"])
        ratios = statistics.median(b / a for a, b in zip(ms["fp16"], ms["fp32"]))
        print(f"batch {batch}: median ms a decode step over {args.rounds} rounds: fp16 scales {fp16_ms:.2f}, "
              f"fp32 {fp32_ms:.2f} ({fp32_ms / fp16_ms:.2f}x; paired rounds' median {ratios:.2f}x)", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
