"""Which Triton kernels compile after the engine has started (GPU, cold Triton cache).

Starts the W1 engine (llama3-8b shape, dummy weights, no prefix caching) on an empty
TRITON_CACHE_DIR, then runs `bench throughput`'s warm-up request and W1's 256 requests twice,
and prints, for each phase, the kernels compiled in it (name, warps, stages) and W1's wall
time. A kernel compiled inside W1's first run is time a first run on a fresh machine loses.

    python benchmarks/gpu_jit_census.py [--quantization fp8] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-census-")


def compiled() -> dict[str, str]:
    """{metadata file: kernel name and specialization} of everything compiled so far."""
    out = {}
    for path in glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.json")):
        if os.path.basename(path).startswith("__grp__"):
            continue
        with open(path) as file:
            meta = json.load(file)
        out[path] = f"{meta.get('name')} warps={meta.get('num_warps')} stages={meta.get('num_stages')}"
    return out


def report(phase: str, before: dict[str, str], after: dict[str, str]) -> None:
    new = collections.Counter(after[p] for p in after.keys() - before.keys())
    print(f"== {phase}: {sum(new.values())} kernels compiled")
    for name, count in sorted(new.items()):
        print(f"  {count:3d} x {name}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    from kvserve.benchmarks.throughput import make_requests, run_kvserve_batched
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    start = time.perf_counter()
    # No prefix caching: the second run must prefill its prompts again.
    llm = LLM(model=None, load_format="dummy", model_shape="llama3-8b", quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False)
    print(f"engine start {time.perf_counter() - start:.1f} s")
    snapshots = [compiled()]
    report("engine start", {}, snapshots[-1])
    requests = make_requests(256, (100, 1024), (100, 1024), llm.engine.model_config.vocab_size, 0)
    llm.generate({"prompt_token_ids": requests[0].prompt_token_ids[:16]}, SamplingParams(temperature=0.0, max_tokens=4))
    snapshots.append(compiled())
    report("bench throughput's warm-up request", snapshots[-2], snapshots[-1])
    for run in (1, 2):
        result = run_kvserve_batched(llm, requests)
        snapshots.append(compiled())
        print(f"W1 run {run}: {result.elapsed_s:.2f} s, {result.output_tok_s:.0f} out tok/s")
        report(f"W1 run {run}", snapshots[-2], snapshots[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
