"""What capturing CUDA graphs at start costs, and what a step pays when its graph was not
captured: builds a speculative (n-gram, k drafts) engine on llama3-8b dummy weights, reports
the start-up wall time, the graphs captured in it and the GPU memory held, then runs one step of every shape a
speculating server meets over short contexts (batches of 1-8 sequences, query widths 1..1+k,
several context lengths) and reports the steps that had to capture a graph and their wall
time against a replayed step's.

    python benchmarks/gpu_graphs_at_start.py [--quantization int4] [-k 4]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from kvserve.llm import LLM

CONTEXTS = (40, 100, 300, 600, 1000)
BATCHES = (1, 2, 3, 5, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int4", help="Weight format of the target model.")
    parser.add_argument("-k", type=int, default=4, help="Drafted tokens a verify step checks.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    llm = LLM(model_shape="llama3-8b", load_format="dummy", quantization=args.quantization,
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    print(f"engine start {time.perf_counter() - start:.1f} s", flush=True)
    runner = llm.engine.runner
    graphs = runner.cuda_graphs
    at_start = len(graphs.graphs)
    print(f"graphs captured at start: {at_start}; GPU memory allocated {torch.cuda.memory_allocated() / 2**30:.2f} "
          f"GiB, of which KV cache {sum(c.nbytes for c in runner.kv_caches) / 2**30:.2f}", flush=True)
    captured_ms, replayed_ms = [], []
    with torch.inference_mode():
        for batch in BATCHES:
            for width in range(1, args.k + 2):
                for context in CONTEXTS:
                    blocks = -(-(context + width) // runner.block_size)
                    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
                    tokens = [[1000 + i] * width for i in range(batch)]
                    before = len(graphs.graphs)
                    torch.cuda.synchronize()
                    step_start = time.perf_counter()
                    graphs.run(tokens, [context] * batch, tables)
                    torch.cuda.synchronize()
                    ms = (time.perf_counter() - step_start) * 1e3
                    (captured_ms if len(graphs.graphs) > before else replayed_ms).append(ms)
    print(f"steps over {len(captured_ms) + len(replayed_ms)} shapes (batches {BATCHES}, widths 1-{args.k + 1}, "
          f"contexts {CONTEXTS}): {len(captured_ms)} captured a graph while serving", flush=True)
    if captured_ms:
        print(f"  a step that captured: median {statistics.median(captured_ms):.1f} ms, "
              f"max {max(captured_ms):.1f}, total {sum(captured_ms) / 1e3:.2f} s", flush=True)
    print(f"  a step that replayed: median {statistics.median(replayed_ms):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
