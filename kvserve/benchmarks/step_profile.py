"""Where an offline run's time goes, by kind of step: decode-only steps (replayed CUDA
graphs where enabled) and steps with prefill tokens (eager), each as model time (the
runner, synchronised) and the rest of the step (scheduling, sampling, bookkeeping).
With overlapped scheduling, decode steps launched ahead are a kind of their own: their
"model" time is the launch only (not synchronised, which would undo the overlap), and the
rest includes waiting for the step before.

    python -m kvserve.benchmarks.step_profile --load-format dummy --model-shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from kvserve.benchmarks.throughput import add_cli_args as add_workload_args
from kvserve.benchmarks.throughput import make_requests
from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


class StepTimer:
    """Wraps the engine's step and its runner's forward passes; sorts each step by its kind."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
        self._kind = ""
        self._model_s = 0.0
        runner, engine = self.engine.core.runner, self.engine
        forward, forward_ahead, step = runner.forward, runner.forward_ahead, engine.step

        def timed_forward(sched):
            tokens = sched.total_num_scheduled_tokens
            self._kind = "decode only" if tokens == len(sched.num_scheduled_tokens) else "with prefill"
            self._tokens = tokens
            self._sync()
            start = time.perf_counter()
            result = forward(sched)
            self._sync()
            self._model_s = time.perf_counter() - start
            return result

        def timed_forward_ahead(sched, token_ids):
            self._kind, self._tokens = "decode ahead", len(sched.num_scheduled_tokens)
            start = time.perf_counter()
            result = forward_ahead(sched, token_ids)
            self._model_s = time.perf_counter() - start
            return result

        def timed_step(**kwargs):
            start = time.perf_counter()
            self._kind = ""
            outputs = step(**kwargs)
            if self._kind:
                entry = self.totals[self._kind]
                entry[0] += 1
                entry[1] += self._model_s
                entry[2] += time.perf_counter() - start - self._model_s
                entry[3] += self._tokens
            return outputs

        runner.forward = timed_forward
        runner.forward_ahead = timed_forward_ahead
        engine.step = timed_step

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def print_table(self, wall_s: float) -> None:
        print(f"\n{'step kind':14s} {'steps':>6s} {'tokens':>8s} {'model s':>8s} {'other s':>8s} "
              f"{'model ms/step':>14s} {'other ms/step':>14s}")
        for kind, (steps, model_s, other_s, tokens) in sorted(self.totals.items()):
            print(f"{kind:14s} {steps:6d} {tokens:8d} {model_s:8.2f} {other_s:8.2f} "
                  f"{model_s / steps * 1e3:14.2f} {other_s / steps * 1e3:14.2f}")
        accounted = sum(model + other for _, model, other, _ in self.totals.values())
        print(f"wall {wall_s:.2f} s, of which outside engine steps {wall_s - accounted:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    add_workload_args(parser)
    args = parser.parse_args(argv)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    requests = make_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                             llm.engine.model_config.vocab_size, args.workload_seed)
    llm.generate({"prompt_token_ids": requests[0].prompt_token_ids[:16]},
                 SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    timer = StepTimer(llm)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                 [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                  for r in requests])
    timer.print_table(time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
