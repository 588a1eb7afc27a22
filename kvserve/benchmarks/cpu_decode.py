"""CPU decode step time, eager against `--compile-decode`, interleaved in one process.

Loads the model once as `kvserve serve` would on CPU (quantization auto) with the compiled
decode built, then alternates the variants round by round (the machine is shared: runs
minutes apart are not comparable): each round runs `batch` requests of random prompt
tokens, greedy with ignore_eos, and times every engine step in which all sequences decode.

    python -m kvserve.benchmarks.cpu_decode --batch-sizes 1,16 --rounds 5 [--batch-invariant]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

VARIANTS = ("eager", "compiled")


class DecodeStepTimer:
    """Wall time of each engine step whose batch is decodes only."""

    def __init__(self, llm: LLM) -> None:
        engine, runner = llm.engine, llm.engine.core.runner
        self.times: list[float] = []
        execute, step = runner.execute, engine.step
        decode_only = [False]

        def timed_execute(sched):
            decode_only[0] = sched.total_num_scheduled_tokens == len(sched.num_scheduled_tokens)
            return execute(sched)

        def timed_step(**kwargs):
            decode_only[0] = False
            start = time.perf_counter()
            outputs = step(**kwargs)
            if decode_only[0]:
                self.times.append(time.perf_counter() - start)
            return outputs

        runner.execute = timed_execute
        engine.step = timed_step


def run_round(llm: LLM, timer: DecodeStepTimer, batch: int, input_len: int, output_len: int,
              seed: int) -> tuple[float, list[int]]:
    """(median ms per decode step, the first request's output tokens)."""
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]}
               for _ in range(batch)]
    timer.times.clear()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    return statistics.median(timer.times) * 1e3, list(outputs[0].outputs[0].token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                        help="route rows as `kvserve serve` does on CPU (docs/batch-invariance.md)")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    start = time.perf_counter()
    # No prefix caching: a variant's rerun of the same prompts must prefill them too.
    llm = LLM(model=args.model, quantization=args.quantization, compile_decode=True,
              batch_invariant=args.batch_invariant, max_num_seqs=max(batch_sizes), enable_prefix_caching=False)
    print(f"load + compile {time.perf_counter() - start:.1f} s, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()}")
    runner = llm.engine.core.runner
    compiled = runner.compiled_decode
    timer = DecodeStepTimer(llm)
    results: dict[tuple[int, str], list[float]] = {}
    for round_index in range(args.rounds):
        for batch in batch_sizes:
            # Alternate which variant goes first, so drifting load hits both alike.
            order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
            tokens = {}
            for variant in order:
                runner.compiled_decode = compiled if variant == "compiled" else None
                ms, tokens[variant] = run_round(llm, timer, batch, args.input_len,
                                                args.output_len, seed=round_index)
                results.setdefault((batch, variant), []).append(ms)
            same = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"]))
            print(f"round {round_index} batch {batch}: " + ", ".join(
                f"{v} {results[batch, v][-1]:.2f} ms" for v in VARIANTS)
                + f" (first request: {same}/{args.output_len} tokens equal)", flush=True)
    print(f"\nmedian ms per decode step over {args.rounds} rounds (load average {os.getloadavg()}):")
    for batch in batch_sizes:
        eager, comp = (statistics.median(results[batch, v]) for v in VARIANTS)
        print(f"batch {batch:3d}: eager {eager:7.2f}  compiled {comp:7.2f}  ({eager / comp:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
