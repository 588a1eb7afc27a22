"""CPU decode step time of `--quantization auto` (int4 g32 linears on SmolLM2) with kvserve's
int4 kernel against torch's `_weight_int4pack_mm_for_cpu`, each up to a row count above which
the kept fp32 weights run, and the fp32 path, all loaded in this one process with their
rounds interleaved (the machine is shared and noisy): 64-token prompts and 64 greedy tokens a
round at each batch size.

    python benchmarks/cpu_int4_kernel.py --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
from kvserve.engine import cpu_defaults
from kvserve.llm import LLM
from kvserve.quantization import int4

BATCH_SIZES = (1, 8, 16)


def load(quantization: str | None, own_int4_kernel: bool, kernel_max_rows: int) -> LLM:
    # Int4Linear picks its kernel, and the plan its row limit, when the model is built: hide
    # kvserve's kernel to get torch's.
    op, rows = int4.int4_matmul_op, cpu_defaults.INT4_FP32_FROM_ROWS
    if not own_int4_kernel:
        int4.int4_matmul_op = lambda: None
    cpu_defaults.INT4_FP32_FROM_ROWS = kernel_max_rows
    try:
        return LLM(model=None, quantization=quantization, compile_decode=True, max_num_seqs=16,
                   enable_prefix_caching=False, max_num_batched_tokens=512)
    finally:
        int4.int4_matmul_op, cpu_defaults.INT4_FP32_FROM_ROWS = op, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per engine and batch size")
    args = parser.parse_args()
    variants = {"fp32": ("none", True, 16), "torch int4 <= 16 rows": ("auto", False, 16),
                "kvserve int4 <= 16 rows": ("auto", True, 16), "kvserve int4 <= 8 rows": ("auto", True, 8)}
    engines = {}
    for name, (quantization, own, rows) in variants.items():
        start = time.perf_counter()
        llm = load(quantization, own, rows)
        engines[name] = llm, DecodeStepTimer(llm)
        print(f"{name}: load + compile {time.perf_counter() - start:.0f} s", flush=True)
    ms: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        for batch in BATCH_SIZES:
            for name in order:
                llm, timer = engines[name]
                ms.setdefault((name, batch), []).append(run_round(llm, timer, batch, 64, 64, seed=round_index)[0])
        print(f"round {round_index}: " + ", ".join(f"{n} b{b} {v[-1]:.2f}" for (n, b), v in ms.items()), flush=True)
    print(f"\nmedian ms per decode step over {args.rounds} interleaved rounds; ratios against fp32:")
    for name in engines:
        cells = []
        for batch in BATCH_SIZES:
            median = statistics.median(ms[name, batch])
            cells.append(f"batch {batch} {median:7.2f} ms ({statistics.median(ms['fp32', batch]) / median:.2f}x)")
        print(f"RESULT {name:24s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
