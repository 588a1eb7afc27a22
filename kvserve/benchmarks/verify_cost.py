"""Time of a speculative verify step (1 + k query tokens of one sequence, logits at every
one) against a plain decode step (1 token).

On a GPU: the engine's own CUDA graphs for both step shapes, replayed back to back so host
work does not hide the difference. On the CPU: the runner's own path for each shape (the
compiled graph where `--compile-decode` is on, else eager) plus the LM head and the greedy
argmax of every row, the two shapes interleaved step by step so that load from elsewhere
on a shared machine falls on both alike; medians of `--repeats` rounds.

    python -m kvserve.benchmarks.verify_cost --load-format dummy --model-shape llama3-8b -k 4
    python -m kvserve.benchmarks.verify_cost -k 4 --context-len 300            # CPU, SmolLM2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.sample.sampler import Sampler, SamplingRow
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.tree import TokenTree, tree_step_inputs


@torch.inference_mode()
def step_time_ms(llm: LLM, num_query_tokens: int, context_len: int, repeats: int = 50,
                 tree: TokenTree | None = None) -> float:
    """A step's replayed graph, a chain of drafts or (`tree`) a token tree's."""
    runner = llm.engine.core.runner
    graphs = runner.cuda_graphs
    if graphs is None:
        raise SystemExit("verify_cost on a GPU needs CUDA graphs: the Triton backend, no --enforce-eager")
    table = list(range(-(-(context_len + num_query_tokens) // runner.block_size)))
    tokens = torch.randint(1000, llm.engine.model_config.vocab_size, (num_query_tokens,))
    trees = None if tree is None else [tree_step_inputs(context_len, tree.parents)]
    graphs.run([tokens.tolist()], [context_len], [table], trees=trees)  # captures this shape's graph
    return statistics.median(graphs.replay_last_ms(repeats) for _ in range(5))


class CpuStep:
    """One sequence's step of `num_query_tokens` after `context_len` cached positions, as
    the runner runs it: metadata (and the attention's plan) built afresh, the compiled
    graph where it applies, the LM head on every row, a greedy argmax per row."""

    def __init__(self, llm: LLM, num_query_tokens: int, context_len: int) -> None:
        self.runner = llm.engine.core.runner
        end = context_len + num_query_tokens
        self.table = list(range(-(-end // self.runner.block_size)))
        self.context_len, self.end = context_len, end
        self.input_ids = torch.randint(1000, llm.engine.model_config.vocab_size, (num_query_tokens,))
        self.positions = torch.arange(context_len, end)
        self.rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], None, [])] * num_query_tokens

    @torch.inference_mode()
    def run(self) -> tuple[float, bool]:
        """(milliseconds, whether the compiled graph ran the step)."""
        runner = self.runner
        start = time.perf_counter()
        metadata = runner._metadata(self.positions, [0, len(self.positions)], [self.end], [self.table])
        compiled = runner.compiled_decode is not None and runner.compiled_decode.applies(metadata)
        if compiled:
            hidden = runner.compiled_decode.forward(self.input_ids, self.positions, metadata)
        else:
            hidden = runner.model(self.input_ids, self.positions, runner.kv_caches, metadata)
        Sampler.sample_ids(runner.model.compute_logits(hidden), self.rows).tolist()
        return (time.perf_counter() - start) * 1e3, compiled


def cpu_step_times_ms(llm: LLM, k: int, context_len: int, repeats: int) -> tuple[float, float, bool]:
    """(decode ms, verify ms, whether both ran compiled): medians over interleaved steps."""
    decode, verify = CpuStep(llm, 1, context_len), CpuStep(llm, 1 + k, context_len)
    for step in (decode, verify):  # warm-up
        step.run()
    times: dict[CpuStep, list[float]] = {decode: [], verify: []}
    compiled = True
    for i in range(repeats):
        for step in (decode, verify) if i % 2 == 0 else (verify, decode):
            ms, ran_compiled = step.run()
            times[step].append(ms)
            compiled &= ran_compiled
    return statistics.median(times[decode]), statistics.median(times[verify]), compiled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4,
                        help="Drafted tokens verified in one step.")
    parser.add_argument("--context-len", type=int, default=256,
                        help="Tokens already in the sequence's cache.")
    parser.add_argument("--repeats", type=int, default=40,
                        help="CPU: steps of each shape, interleaved; the median is reported.")
    parser.add_argument("--tree", action="store_true",
                        help="GPU: the k drafts as a token tree (the default tree of k nodes, 4 deep) "
                             "rather than a chain.")
    args = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.speculative_config is None:
        # Sizes the engine's graphs for verify steps of 1 + k tokens.
        engine_args.speculative_config = {
            "method": "ngram", "num_speculative_tokens": args.num_speculative_tokens
        }
    llm = LLM(**vars(engine_args))
    k = args.num_speculative_tokens
    if llm.engine.device.type == "cpu":
        plain, verify, compiled = cpu_step_times_ms(llm, k, args.context_len, args.repeats)
        path = "compiled graph" if compiled else "eager"
    else:
        plain = step_time_ms(llm, 1, args.context_len)
        tree = TokenTree.default(num_nodes=k, max_depth=4) if args.tree else None
        verify = step_time_ms(llm, 1 + k, args.context_len, tree=tree)
        path = "CUDA graphs, a token tree" if tree is not None else "CUDA graphs"
    print(f"plain decode step {plain:.3f} ms, verify step (k={k}) {verify:.3f} ms: {verify / plain:.3f}x ({path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
