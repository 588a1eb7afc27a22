"""`kvserve bench latency` (W2): a batch of identical-length requests, prompt 128 and 256
output tokens by default, greedy, ignore_eos. Reports TTFT and time per output token beside
the floor: the bytes a decode step must read (weights once plus the live KV) over the copy
bandwidth measured on the same device in the same run, and the decode steps' median and
slowest wall times (a mean TPOT above the median step is a few slow steps; at the median,
every step slower). With CUDA graphs, also their device time: the graph the run replayed
most (the whole batch's) replayed back to back (GPU ms) and the median of the graphs as the
run replayed them (graph p50)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from kvserve.benchmarks.roofline import (
    copy_bandwidth,
    decode_step_floor_s,
    kv_bytes_per_token,
)
from kvserve.benchmarks.lora_throughput import add_lora_comparison_args
from kvserve.benchmarks.throughput import make_requests
from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.lora.request import LoRARequest
from kvserve.model_executor.model_bytes import decode_step_weight_bytes
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections import Counter

    from kvserve.model_executor.cuda_graphs import CudaGraphRunner


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    ttft_ms_median: float
    tpot_ms_median: float  # decode time per output token of one request = one decode step
    output_tok_s: float  # batch_size / TPOT
    floor_ms: float  # at the mean context length of the decode phase
    fraction_of_floor: float  # floor / measured; 1.0 would be at the floor
    # Device time of the decode graph the run replayed most (the whole batch's: with its
    # prefill split over several steps, a batch's last steps run fewer sequences), alone and
    # replayed back to back, when graphs are in use. TPOT minus this is what runs between
    # graphs (sampling, the input copies, the gaps between them;
    # benchmarks/gpu_decode_timeline.py splits it up), less what the earlier steps' shorter
    # contexts save.
    gpu_step_ms: float | None = None
    # Median device time of the decode graphs as the run replayed them, one a step (CUDA
    # events around each replay).
    served_graph_ms: float | None = None
    # Wall time of the engine steps from the batch's last first token to its first finish
    # (a token a request each, more with speculative decoding): median, slowest, how many.
    step_ms_median: float | None = None
    step_ms_max: float | None = None
    decode_steps: int = 0


def run_latency(llm: LLM, batch_size: int, input_len: int, output_len: int,
                bandwidth: float, seed: int = 0, loras: list[LoRARequest] | None = None) -> LatencyResult:
    """`loras`: the batch's requests spread over these adapters (None: the base model)."""
    engine = llm.engine
    requests = make_requests(batch_size, (input_len, input_len), (output_len, output_len),
                             engine.model_config.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    step_ends: list[float] = []  # time.time(), the clock of RequestMetrics
    # The replay timings of CUDA graphs need the core in this process.
    graphs = None if engine.core is None else engine.core.runner.cuda_graphs
    if graphs is not None:
        graphs.replay_events = []
        replays_before = graphs.replays.copy()
    try:
        outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params,
                               on_step=lambda: step_ends.append(time.time()),
                               lora_request=[loras[i % len(loras)] for i in range(batch_size)] if loras else None)
        served = graphs.served_replay_ms() if graphs is not None else []
        gpu_step_ms = _most_replayed_ms(graphs, replays_before) if graphs is not None else None
    finally:
        if graphs is not None:
            graphs.replay_events = None
    steps = decode_step_times(step_ends, max(o.metrics.first_token_time for o in outputs),
                              min(o.metrics.finished_time for o in outputs))
    ttfts, tpots = [], []
    for output in outputs:
        times = output.metrics
        ttfts.append(times.first_token_time - times.arrival_time)
        tpots.append((times.finished_time - times.first_token_time) / max(1, output_len - 1))
    tpot = statistics.median(tpots)
    mean_context = input_len + output_len / 2
    floor = decode_step_floor_s(
        decode_step_weight_bytes(engine.client.info.decode_weight_bytes, engine.client.info.expert_weight_bytes,
                                 engine.model_config, batch_size),
        kv_bytes_per_token(engine.model_config, engine.client.info.kv_cache_dtype),
        round(batch_size * mean_context), bandwidth,
    )
    return LatencyResult(batch_size, input_len, output_len, statistics.median(ttfts) * 1e3,
                         tpot * 1e3, batch_size / tpot, floor * 1e3, floor / tpot,
                         gpu_step_ms=gpu_step_ms,
                         served_graph_ms=statistics.median(served) if served else None,
                         step_ms_median=statistics.median(steps) * 1e3 if steps else None,
                         step_ms_max=max(steps) * 1e3 if steps else None, decode_steps=len(steps))


def decode_step_times(step_ends: list[float], decode_start: float, decode_end: float) -> list[float]:
    """The durations of the steps after the one that gave the batch's last first token,
    through the one in which the first request finished (s)."""
    first = next(i for i, t in enumerate(step_ends) if t >= decode_start)
    last = next(i for i, t in enumerate(step_ends) if t >= decode_end)
    return [b - a for a, b in zip(step_ends[first:last], step_ends[first + 1:last + 1])]


def _most_replayed_ms(graphs: CudaGraphRunner, replays_before: Counter) -> float | None:
    """The device time of the graph replayed most since `replays_before` (the runner's replay
    counts then), replayed back to back; None if none was."""
    replayed = graphs.replays - replays_before
    return graphs.replay_ms(replayed.most_common(1)[0][0]) if replayed else None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    group.add_argument("--output-len", type=int, default=256, help="Output tokens per request (EOS ignored).")
    group.add_argument("--batch-sizes", default="1", help="Comma-separated batch sizes, e.g. 1,16,64.")
    group.add_argument("--workload-seed", type=int, default=0, help="Seed of the random prompts.")
    group.add_argument("--output-json", default=None, help="Write the results to this file.")
    group.add_argument("--profile-host", action="store_true",
                       help="Also print where the host spends a batch-1 run's time (cProfile).")
    add_lora_comparison_args(group, "each batch's requests spread over them (batch 1: one adapter)")


def run_from_args(args: argparse.Namespace) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = EngineArgs.from_cli_args(args)
    # Before the engine: on a GPU its KV cache takes the memory a large copy needs.
    bandwidth = copy_bandwidth(engine_args.resolved_device())
    if args.num_loras:
        return _compare_with_loras(args, engine_args, batch_sizes, bandwidth)
    llm = LLM(**vars(engine_args))
    run_latency(llm, 1, min(16, args.input_len), 4, bandwidth)  # warm-up
    results = [run_latency(llm, b, args.input_len, args.output_len, bandwidth, args.workload_seed)
               for b in batch_sizes]
    if args.profile_host:
        _profile_host(llm, args.input_len, args.output_len)
    print(f"\nmeasured copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    print(f"{'batch':>5s} {'TTFT ms':>9s} {'TPOT ms':>9s} {'out tok/s':>10s} {'floor ms':>9s} "
          f"{'of floor':>9s} {'GPU ms':>7s} {'graph p50':>9s} {'step p50':>8s} {'step max':>8s}")
    for r in results:
        gpu = f"{r.gpu_step_ms:7.2f}" if r.gpu_step_ms is not None else f"{'-':>7s}"
        gpu += f" {r.served_graph_ms:9.2f}" if r.served_graph_ms is not None else f" {'-':>9s}"
        steps = (f"{r.step_ms_median:8.2f} {r.step_ms_max:8.2f}" if r.step_ms_median is not None
                 else f"{'-':>8s} {'-':>8s}")
        print(f"{r.batch_size:5d} {r.ttft_ms_median:9.1f} {r.tpot_ms_median:9.2f} "
              f"{r.output_tok_s:10.1f} {r.floor_ms:9.2f} {r.fraction_of_floor:9.0%} {gpu} {steps}")
    stats = llm.engine.spec_decode_stats
    if stats is not None:
        print(f"speculative decoding: {stats.num_drafts} verify runs, acceptance "
              f"{stats.acceptance_rate:.1%}, mean accepted length {stats.mean_accepted_length:.2f} "
              "(random prompts: acceptance depends on the weights)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"copy_bandwidth_bytes_per_s": bandwidth,
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


def _profile_host(llm: LLM, input_len: int, output_len: int) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_latency(llm, 1, input_len, output_len, bandwidth=1.0)
    profiler.disable()
    print(f"\nhost profile of one batch-1 request ({output_len} tokens), by own time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def _compare_with_loras(args: argparse.Namespace, engine_args: EngineArgs, batch_sizes: list[int],
                        bandwidth: float) -> int:
    """TPOT of the base model, then of an engine serving --num-loras random adapters on the
    same requests (the base engine freed first, so the LoRA one sizes its own KV cache)."""
    import tempfile

    from kvserve.benchmarks.lora_throughput import free_engine_memory, lora_engine_args, random_adapters

    runs: dict[str, list[LatencyResult]] = {}
    with tempfile.TemporaryDirectory() as directory:
        adapters: list[LoRARequest] | None = None
        for name in ("base", "lora"):
            llm = LLM(**vars(lora_engine_args(engine_args, args.num_loras, args.lora_rank) if name == "lora"
                             else replace(engine_args, enable_lora=False)))
            if name == "lora":
                adapters = random_adapters(directory, llm.engine.model_config, args.num_loras, args.lora_rank)
            run_latency(llm, 1, min(16, args.input_len), 4, bandwidth, loras=adapters)  # warm-up
            runs[name] = [run_latency(llm, b, args.input_len, args.output_len, bandwidth, args.workload_seed,
                                      loras=adapters) for b in batch_sizes]
            del llm
            free_engine_memory()
    print(f"\n{args.num_loras} random LoRA adapters of rank {args.lora_rank}, each batch's requests spread over them")
    print(f"{'batch':>5s} {'base TPOT ms':>13s} {'LoRA TPOT ms':>13s} {'LoRA / base':>12s} "
          f"{'base TTFT ms':>13s} {'LoRA TTFT ms':>13s}")
    for base, lora in zip(runs["base"], runs["lora"]):
        print(f"{base.batch_size:5d} {base.tpot_ms_median:13.2f} {lora.tpot_ms_median:13.2f} "
              f"{lora.tpot_ms_median / base.tpot_ms_median:11.2f}x {base.ttft_ms_median:13.1f} "
              f"{lora.ttft_ms_median:13.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"num_loras": args.num_loras, "lora_rank": args.lora_rank,
                       "base": [asdict(r) for r in runs["base"]], "lora": [asdict(r) for r in runs["lora"]]},
                      f, indent=2)
    return 0
