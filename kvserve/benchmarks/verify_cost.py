"""Device time of a speculative verify step (1 + k query tokens of one sequence, logits at
every one) against a plain decode step (1 token): the engine's own CUDA graphs for both
step shapes, replayed back to back so host work does not hide the difference.

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
    runner = llm.engine.core.runner
    graphs = runner.cuda_graphs
    if graphs is None:
        raise SystemExit("verify_cost needs CUDA graphs: a CUDA device, the Triton backend, "
                         "no --enforce-eager")
    table = list(range(-(-(context_len + num_query_tokens) // runner.block_size)))
    tokens = torch.randint(1000, llm.engine.model_config.vocab_size, (num_query_tokens,))
    graphs.run([tokens.tolist()], [context_len], [table])  # captures this shape's graph
    return statistics.median(graphs.replay_last_ms(repeats) for _ in range(5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4,
                        help="Drafted tokens verified in one step.")
    parser.add_argument("--context-len", type=int, default=256,
                        help="Tokens already in the sequence's cache.")
    args = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.speculative_config is None:
        # Sizes the engine's graphs for verify steps of 1 + k tokens.
        engine_args.speculative_config = {
            "method": "ngram", "num_speculative_tokens": args.num_speculative_tokens
        }
    llm = LLM(**vars(engine_args))
    plain = step_time_ms(llm, 1, args.context_len)
    verify = step_time_ms(llm, 1 + args.num_speculative_tokens, args.context_len)
    print(f"plain decode step {plain:.3f} ms, verify step (k={args.num_speculative_tokens}) "
          f"{verify:.3f} ms: {verify / plain:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
