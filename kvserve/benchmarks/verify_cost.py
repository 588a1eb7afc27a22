"""Device time of a speculative verify step (1 + k query tokens of one sequence, logits at
every one) against a plain decode step (1 token), each captured in a CUDA graph and
replayed back to back, so host work does not hide the difference.

    python -m kvserve.benchmarks.verify_cost --load-format dummy --model-shape llama3-8b -k 4
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM


@torch.inference_mode()
def step_time_ms(llm: LLM, num_query_tokens: int, context_len: int, repeats: int = 50) -> float:
    runner = llm.engine.runner
    block_size = runner.block_size
    seq_len = context_len + num_query_tokens
    table = list(range(-(-seq_len // block_size)))
    positions = torch.arange(context_len, seq_len, device=runner.device)
    input_ids = torch.randint(1000, llm.engine.model_config.vocab_size, (num_query_tokens,),
                              device=runner.device)
    metadata = runner._metadata(positions, [0, num_query_tokens], [seq_len], [table])

    def forward() -> torch.Tensor:
        hidden = runner.model(input_ids, positions, runner.kv_caches, metadata)
        return runner.model.compute_logits(hidden)

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4,
                        help="Drafted tokens verified in one step.")
    parser.add_argument("--context-len", type=int, default=256,
                        help="Tokens already in the sequence's cache.")
    args = parser.parse_args(argv)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    plain = step_time_ms(llm, 1, args.context_len)
    verify = step_time_ms(llm, 1 + args.num_speculative_tokens, args.context_len)
    print(f"plain decode step {plain:.3f} ms, verify step (k={args.num_speculative_tokens}) "
          f"{verify:.3f} ms: {verify / plain:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
