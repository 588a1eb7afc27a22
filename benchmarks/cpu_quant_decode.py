"""CPU decode step time of the embedded SmolLM2 per quantization, with the compiled decode
step (what `kvserve serve` runs), at batch 1 and 16: medians of 3 rounds of 64-token prompts
and 64 greedy tokens. One quantization per process (each compiles its own graphs):

    for q in none int8 int8-head gguf auto; do python benchmarks/cpu_quant_decode.py $q; done

`int8-head` is int8 with its LM head option (`quantization_config={"lm_head": true}`).
"""

from __future__ import annotations

import statistics
import sys
import time

from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
from kvserve.llm import LLM


# Names that are a quantization plus its config.
VARIANTS = {"none": (None, None), "int8-head": ("int8", {"lm_head": True})}


def main(name: str) -> None:
    quantization, config = VARIANTS.get(name, (name, None))
    start = time.perf_counter()
    llm = LLM(model=None, quantization=quantization, quantization_config=config, compile_decode=True,
              max_num_seqs=16, enable_prefix_caching=False, max_num_batched_tokens=512)
    load_s = time.perf_counter() - start
    timer = DecodeStepTimer(llm)
    ms = {batch: statistics.median(run_round(llm, timer, batch, 64, 64, seed=r)[0] for r in range(3))
          for batch in (1, 16)}
    print(f"RESULT {name}: load+compile {load_s:.0f} s, batch 1 {ms[1]:.2f} ms/step "
          f"({1000 / ms[1]:.1f} tok/s), batch 16 {ms[16]:.2f} ms/step ({16000 / ms[16]:.0f} tok/s)")


if __name__ == "__main__":
    main(sys.argv[1])
