"""CPU decode step time with kvserve's decode attention kernel against the gathered copy +
SDPA path, for fp32 and int8 (+ int8 LM head) SmolLM2 with the compiled decode step: all four
engines loaded in this one process and their rounds interleaved (the machine is shared and
noisy), batch 1 and 16, 64-token prompts and 64 greedy tokens a round:

    python benchmarks/cpu_decode_attention.py --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.attention.torch_ref import TorchReferenceBackend
from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
from kvserve.llm import LLM

MODELS = {"fp32": (None, None), "int8-head": ("int8", {"lm_head": True})}
BATCH_SIZES = (1, 16)


def load(quantization: str | None, config: dict | None, decode_kernel: bool) -> LLM:
    # The engine builds its backend with the default; the compiled graphs bake the choice in.
    defaults = TorchReferenceBackend.__init__.__defaults__
    TorchReferenceBackend.__init__.__defaults__ = (None, decode_kernel)
    try:
        llm = LLM(model=None, quantization=quantization, quantization_config=config, compile_decode=True,
                  max_num_seqs=16, enable_prefix_caching=False, max_num_batched_tokens=512)
    finally:
        TorchReferenceBackend.__init__.__defaults__ = defaults
    assert llm.engine.runner.attn_backend.decode_kernel == decode_kernel
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per engine and batch size")
    args = parser.parse_args()
    engines = {}
    for decode_kernel in (False, True):
        for name, (quantization, config) in MODELS.items():
            start = time.perf_counter()
            llm = load(quantization, config, decode_kernel)
            engines[name, decode_kernel] = llm, DecodeStepTimer(llm)
            print(f"{name} kernel={decode_kernel}: load + compile {time.perf_counter() - start:.0f} s", flush=True)
    ms: dict[tuple, list[float]] = {}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        for batch in BATCH_SIZES:
            for key in order:
                llm, timer = engines[key]
                ms.setdefault((*key, batch), []).append(run_round(llm, timer, batch, 64, 64, seed=round_index)[0])
        print(f"round {round_index}: " + ", ".join(f"{n} kernel={k} b{b} {v[-1]:.2f}" for (n, k, b), v in ms.items()),
              flush=True)
    print(f"\nmedian ms per decode step over {args.rounds} interleaved rounds:")
    for batch in BATCH_SIZES:
        for name in MODELS:
            gathered, kernel = (statistics.median(ms[name, k, batch]) for k in (False, True))
            print(f"RESULT batch {batch:2d} {name:9s}: gathered + SDPA {gathered:7.2f}, kernel {kernel:7.2f} "
                  f"({gathered / kernel:.2f}x)")
    for batch in BATCH_SIZES:
        for kernel in (False, True):
            ratio = statistics.median(ms["fp32", kernel, batch]) / statistics.median(ms["int8-head", kernel, batch])
            print(f"RESULT batch {batch:2d} kernel={kernel}: int8-head is {ratio:.2f}x fp32")


if __name__ == "__main__":
    main()
