"""The auto plan's dense copies on this CPU, fp32 against bf16 (and the bf16 plan's row limit
between the quantized kernels and the copies), in one process with interleaved rounds: the
median decode step at 4 / 8 / 12 / 16 sequences and one prefill of 16 prompts of 128 tokens.
Not batch-invariant (`LLM`'s default), so decode rows past the limit take the dense copies.

    python benchmarks/cpu_dense_plans.py [--model F] [--rounds 3]

Each variant is the plan a CPU gets whose start-up probe measured that bf16 speedup.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
from kvserve.llm import LLM
from kvserve.quantization import cpu_plan
from kvserve.sampling_params import SamplingParams

# name: (the probe's bf16 speedup, BF16_FROM_ROWS)
VARIANTS = {"fp32": (0.01, cpu_plan.BF16_FROM_ROWS), "bf16>4": (5.0, 4), "bf16>8": (5.0, 8), "bf16>16": (5.0, 16)}
BATCH_SIZES = (4, 8, 12, 16)


def load(model: str | None, speedup: float, bf16_from_rows: int) -> LLM:
    cpu_plan.measured_bf16_speedup = lambda *shape: speedup
    cpu_plan.BF16_FROM_ROWS = bf16_from_rows
    return LLM(model=model, quantization="auto", compile_decode=True, max_num_seqs=16, enable_prefix_caching=False,
               max_num_batched_tokens=512, kv_cache_memory="256MiB", max_model_len=2048)


def prefill_ms(llm: LLM, seed: int) -> float:
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(128)]} for _ in range(16)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model path (default: the embedded SmolLM2).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds per variant (default: 3).")
    args = parser.parse_args()
    engines = {}
    for name, (speedup, rows) in VARIANTS.items():
        llm = load(args.model, speedup, rows)
        engines[name] = (llm, DecodeStepTimer(llm))
    ms: dict[tuple[str, str], list[float]] = {}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:  # drifting load hits all alike
            llm, timer = engines[name]
            for batch in BATCH_SIZES:
                ms.setdefault((name, f"step{batch}"), []).append(
                    run_round(llm, timer, batch, 32, 32, seed=round_index)[0])
            ms.setdefault((name, "prefill"), []).append(prefill_ms(llm, round_index))
    keys = [f"step{batch}" for batch in BATCH_SIZES] + ["prefill"]
    print(f"{args.model or 'embedded SmolLM2'}, medians of {args.rounds} rounds, ms")
    print(f"{'':10s}" + "".join(f"{key:>10s}" for key in keys))
    for name in names:
        print(f"{name:10s}" + "".join(f"{statistics.median(ms[(name, key)]):10.1f}" for key in keys))


if __name__ == "__main__":
    main()
