"""What streaming costs the engine's host per step: the same 256 requests (64-token prompts,
1,900 greedy tokens each) stepped with `final_only=False` (an output for every request every
step, as the server streams) and `final_only=True` (outputs at the end, as LLM.generate
runs), on a one-layer 64-wide Llama so that the host's work dominates. Prints the tree it
imported kvserve from, for A/B runs of two trees (`PYTHONPATH=<tree>:.`).

    PYTHONPATH=. python benchmarks/cpu_streaming_outputs.py
"""

from __future__ import annotations

import time

import torch

import kvserve
from benchmarks.cpu_engine_host_step import tiny_model_dir
from kvserve import LLM, SamplingParams


def main() -> None:
    torch.set_num_threads(1)
    llm = LLM(model=tiny_model_dir(), device="cpu", dtype="float32", max_num_seqs=256, kv_cache_memory="1GiB",
              overlap_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True)
    for final_only in (False, True):
        for i in range(256):
            engine.add_request(None, {"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(64)]}, params)
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step(final_only=final_only)
            steps += 1
        elapsed = time.perf_counter() - start
        print(f"kvserve from {kvserve.__file__.rsplit('/', 2)[0]}: final_only={final_only}: "
              f"{elapsed / steps * 1e3:.2f} ms a step over {steps} steps", flush=True)


if __name__ == "__main__":
    main()
