"""CPU decode step time of the embedded SmolLM2 (or `--model`) per quantization, with the compiled decode
step (what `kvserve serve` runs), at batch 1 and 16: 64-token prompts and 64 greedy tokens a
round. Every variant named is loaded in this one process and the rounds alternate between
them (the machine is shared and noisy: runs minutes apart are not comparable), so the ratios
printed compare steps timed side by side:

    python benchmarks/cpu_quant_decode.py none int8 int8-head --rounds 5

`int8` quantizes the LM head too on CPU (its default); `int8-nohead` is
int8 with the float head only (`quantization_config={"lm_head": false}`), `int8-head` asks for
the head explicitly; `int4-int8head` and `int4-nohead` are int4 with an int8 copy of the head
and with the float head only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
from kvserve.llm import LLM

# Names that are a quantization plus its config.
VARIANTS = {"none": (None, None), "int8-head": ("int8", {"lm_head": True}),
            "int8-nohead": ("int8", {"lm_head": False}), "int4-int8head": ("int4", {"lm_head": "int8"}),
            "int4-nohead": ("int4", {"lm_head": False})}


def load(name: str, model: str | None) -> tuple[LLM, DecodeStepTimer]:
    quantization, config = VARIANTS.get(name, (name, None))
    start = time.perf_counter()
    llm = LLM(model=model, quantization=quantization, quantization_config=config, compile_decode=True,
              max_num_seqs=16, enable_prefix_caching=False, max_num_batched_tokens=512)
    print(f"{name}: load + compile {time.perf_counter() - start:.0f} s", flush=True)
    return llm, DecodeStepTimer(llm)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+",
                        help="Variants to load and alternate: none, int8, int8-head, int8-nohead, int4, "
                             "int4-int8head, int4-nohead, gguf, auto. Ratios are against the first.")
    parser.add_argument("--rounds", type=int, default=5, help="Rounds per variant and batch size (default: 5).")
    parser.add_argument("--batch-sizes", default="1,16", help="Comma-separated decode batch sizes (default: 1,16).")
    parser.add_argument("--model", default=None, help="Model path (default: the embedded SmolLM2).")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engines = {name: load(name, args.model) for name in args.variants}
    ms: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        # Alternate which variant goes first, so drifting load hits all alike.
        order = args.variants if round_index % 2 == 0 else args.variants[::-1]
        for batch in batch_sizes:
            for name in order:
                llm, timer = engines[name]
                ms.setdefault((name, batch), []).append(run_round(llm, timer, batch, 64, 64, seed=round_index)[0])
        print(f"round {round_index}: " + ", ".join(
            f"{name} b{batch} {ms[name, batch][-1]:.2f}" for batch in batch_sizes for name in args.variants),
            flush=True)
    base = args.variants[0]
    print(f"\nmedian ms per decode step over {args.rounds} interleaved rounds "
          f"(load average {os.getloadavg()[0]:.2f}); ratios against {base}:")
    for name in args.variants:
        cells = []
        for batch in batch_sizes:
            median = statistics.median(ms[name, batch])
            ratio = statistics.median(ms[base, batch]) / median
            cells.append(f"batch {batch} {median:7.2f} ms ({batch * 1000 / median:6.1f} tok/s, {ratio:.2f}x)")
        print(f"RESULT {name:10s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
