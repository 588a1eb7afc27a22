"""`kvserve bench latency` (W2): a batch of identical-length requests, prompt 128 and 256
output tokens by default, greedy, ignore_eos. Reports TTFT and time per output token beside
the floor: the bytes a decode step must read (weights once plus the live KV) over the copy
bandwidth measured on the same device in the same run, and the decode steps' median and
slowest wall times (a mean TPOT above the median step is a few slow steps; at the median,
every step slower). With CUDA graphs, also their device time: the graph the run replayed
most (the whole batch's) replayed back to back (GPU ms) and the median of the graphs as the
run replayed them (graph p50).

With `--num-loras N --lora-rank R`, the same batches twice in one process: on the base model,
then on the model serving N random adapters (rank R, all seven projections), the requests of
a batch spread evenly over them, with the LoRA/base ratio of TPOT (e.g. batch 1 with one
adapter against the base model in ms per token)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvserve.benchmarks.roofline import (
    copy_bandwidth,
    decode_step_floor_s,
    kv_bytes_per_token,
)
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
                bandwidth: float, seed: int = 0, adapters: list[LoRARequest] | None = None) -> LatencyResult:
    """`adapters`: LoRA adapters the batch's requests are spread over evenly (request i on
    adapter i mod N); none: the base model."""
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
                               lora_request=[adapters[i % len(adapters)] for i in range(batch_size)]
                               if adapters else None)
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
    group.add_argument("--num-loras", type=int, default=0,
                       help="Also run the batches on the model serving this many random LoRA adapters (PEFT "
                       "format, the model's real shapes, all seven projections), each batch's requests spread "
                       "evenly over them, after the base model's runs in the same process (the LoRA engine "
                       "with at least this many --max-loras slots), and print the LoRA/base TPOT ratio. "
                       "0: the base model only.")
    group.add_argument("--lora-rank", type=int, default=16, help="Rank of the random adapters of --num-loras.")


def run_from_args(args: argparse.Namespace) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = EngineArgs.from_cli_args(args)
    # Before the engine: on a GPU its KV cache takes the memory a large copy needs.
    bandwidth = copy_bandwidth(engine_args.resolved_device())
    llm = LLM(**vars(engine_args))
    results = _run_batches(llm, args, batch_sizes, bandwidth)
    if args.profile_host:
        _profile_host(llm, args.input_len, args.output_len)
    print(f"\nmeasured copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    if args.num_loras:
        print("\nbase model:")
    _print_table(results)
    stats = llm.engine.spec_decode_stats
    if stats is not None:
        print(f"speculative decoding: {stats.num_drafts} verify runs, acceptance "
              f"{stats.acceptance_rate:.1%}, mean accepted length {stats.mean_accepted_length:.2f} "
              "(random prompts: acceptance depends on the weights)")
    report = {"copy_bandwidth_bytes_per_s": bandwidth, "results": [asdict(r) for r in results]}
    if args.num_loras:
        from kvserve.benchmarks.lora_throughput import free_engine_memory, lora_engine_args, random_adapters

        config = llm.engine.model_config
        del llm  # freed first: the LoRA engine sizes its KV cache from the memory left
        free_engine_memory()
        with tempfile.TemporaryDirectory() as directory:
            adapters = random_adapters(directory, config, args.num_loras, args.lora_rank)
            llm = LLM(**vars(lora_engine_args(engine_args, args.num_loras, args.lora_rank)))
            lora_results = _run_batches(llm, args, batch_sizes, bandwidth, adapters)
        print(f"\n{args.num_loras} random LoRA adapter(s) of rank {args.lora_rank}, each batch's requests "
              "spread evenly over them:")
        _print_table(lora_results)
        ratios = [r.tpot_ms_median / b.tpot_ms_median for r, b in zip(lora_results, results)]
        print("LoRA / base TPOT: " + ", ".join(f"batch {r.batch_size} {ratio:.2f}x"
                                               for r, ratio in zip(results, ratios)))
        report.update(num_loras=args.num_loras, lora_rank=args.lora_rank,
                      lora_results=[asdict(r) for r in lora_results], lora_vs_base_tpot=ratios)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _run_batches(llm: LLM, args: argparse.Namespace, batch_sizes: list[int], bandwidth: float,
                 adapters: list[LoRARequest] | None = None) -> list[LatencyResult]:
    # Warm-up; one request an adapter, so that each is in its slot before the measured runs.
    run_latency(llm, len(adapters) if adapters else 1, min(16, args.input_len), 4, bandwidth, adapters=adapters)
    return [run_latency(llm, b, args.input_len, args.output_len, bandwidth, args.workload_seed, adapters)
            for b in batch_sizes]


def _print_table(results: list[LatencyResult]) -> None:
    print(f"{'batch':>5s} {'TTFT ms':>9s} {'TPOT ms':>9s} {'out tok/s':>10s} {'floor ms':>9s} "
          f"{'of floor':>9s} {'GPU ms':>7s} {'graph p50':>9s} {'step p50':>8s} {'step max':>8s}")
    for r in results:
        gpu = f"{r.gpu_step_ms:7.2f}" if r.gpu_step_ms is not None else f"{'-':>7s}"
        gpu += f" {r.served_graph_ms:9.2f}" if r.served_graph_ms is not None else f" {'-':>9s}"
        steps = (f"{r.step_ms_median:8.2f} {r.step_ms_max:8.2f}" if r.step_ms_median is not None
                 else f"{'-':>8s} {'-':>8s}")
        print(f"{r.batch_size:5d} {r.ttft_ms_median:9.1f} {r.tpot_ms_median:9.2f} "
              f"{r.output_tok_s:10.1f} {r.floor_ms:9.2f} {r.fraction_of_floor:9.0%} {gpu} {steps}")


def _profile_host(llm: LLM, input_len: int, output_len: int) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_latency(llm, 1, input_len, output_len, bandwidth=1.0)
    profiler.disable()
    print(f"\nhost profile of one batch-1 request ({output_len} tokens), by own time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
