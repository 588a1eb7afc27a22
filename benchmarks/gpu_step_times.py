"""Wall time of each engine step of one W2 request (llama3-8b dummy weights, batch 1, 128
prompt tokens, 128 output tokens, after W2's own warm-up): the median step and the slow
ones, which a mean TPOT folds in without saying so (a JIT compile or a graph capture in the
middle of the run).

    python benchmarks/gpu_step_times.py [--quantization int4|fp8|none]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.benchmarks.latency import run_latency
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="int4", help="int4, fp8 or none.")
    parser.add_argument("--model-shape", default="llama3-8b", help="Dummy model shape.")
    parser.add_argument("--output-len", type=int, default=128, help="Output tokens.")
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(load_format="dummy", model_shape=args.model_shape, quantization=quantization)
    run_latency(llm, 1, 16, 4, bandwidth=3e12)  # W2's warm-up
    engine = llm.engine
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(128)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.add_request(None, {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start) * 1e3)
    decode = steps[1:]
    median = statistics.median(decode)
    slow = sorted(((ms, i + 1) for i, ms in enumerate(decode)), reverse=True)[:5]
    print(f"{args.quantization}: {len(steps)} steps; first {steps[0]:.2f} ms; decode mean {statistics.mean(decode):.3f}, "
          f"median {median:.3f} ms; above 2x median: {sum(ms - median for ms in decode if ms > 2 * median):.1f} ms "
          f"in all; slowest (ms, step): " + ", ".join(f"{ms:.2f} @{i}" for ms, i in slow))


if __name__ == "__main__":
    main()
