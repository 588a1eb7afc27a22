"""`kvserve bench throughput`: offline throughput on random-token requests.

Runs, in one process and on the same requests: kvserve with continuous batching, the same
requests one at a time through kvserve, and (optionally) transformers `generate` one at a
time. Reports output tok/s and total tok/s, wall time from first submit to last token.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from kvserve.benchmarks.lora_throughput import add_lora_comparison_args
from kvserve.benchmarks.roofline import (
    copy_bandwidth,
    matmul_peak_flops,
    offline_floor_s,
)
from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class ThroughputResult:
    name: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def make_requests(
    num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    # Avoid the lowest ids, which hold special tokens in most vocabularies.
    low = min(1000, vocab_size // 2)
    return [
        BenchRequest(
            [rng.randrange(low, vocab_size) for _ in range(rng.randint(*input_len))],
            rng.randint(*output_len),
        )
        for _ in range(num)
    ]


def _params(request: BenchRequest) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)


def run_kvserve_batched(llm: LLM, requests: list[BenchRequest]) -> ThroughputResult:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, [_params(r) for r in requests], use_tqdm=True)
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        "kvserve continuous batching", len(requests), elapsed,
        sum(len(r.prompt_token_ids) for r in requests),
        sum(len(o.outputs[0].token_ids) for o in outputs),
    )


def run_kvserve_sequential(llm: LLM, requests: list[BenchRequest]) -> ThroughputResult:
    output_tokens = 0
    start = time.perf_counter()
    for request in requests:
        output = llm.generate({"prompt_token_ids": request.prompt_token_ids}, _params(request))
        output_tokens += len(output[0].outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        "kvserve one at a time", len(requests), elapsed,
        sum(len(r.prompt_token_ids) for r in requests), output_tokens,
    )


def run_transformers_sequential(model_path: str, requests: list[BenchRequest], device: torch.device) -> ThroughputResult:
    from kvserve.benchmarks.hf_reference import load_hf_model

    model = load_hf_model(model_path, device)
    output_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for request in requests:
            ids = torch.tensor([request.prompt_token_ids], device=device)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=request.output_len, min_new_tokens=request.output_len,
                pad_token_id=0,
            )
            output_tokens += out.shape[1] - ids.shape[1]
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        "transformers generate, one at a time", len(requests), elapsed,
        sum(len(r.prompt_token_ids) for r in requests), output_tokens,
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=32, help="Number of requests.")
    group.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                       help="Prompt length range (uniform, inclusive).")
    group.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                       help="Output length range (uniform, inclusive); EOS is ignored.")
    group.add_argument("--workload-seed", type=int, default=0, help="Seed of the random requests.")
    group.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                       help="Also run the requests one at a time through kvserve.")
    group.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                       help="Also run transformers generate one at a time (real models only).")
    group.add_argument("--output-json", default=None, help="Write the results to this file.")
    add_lora_comparison_args(group, "the requests spread evenly over them")


def run_from_args(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    # Before the engine: on a GPU its KV cache takes the memory these measurements need.
    device = engine_args.resolved_device()
    ceilings = copy_bandwidth(device), matmul_peak_flops(device)
    # fp8 weights run prefill on the fp8 tensor cores: their floor counts that rate.
    fp8_linears = engine_args.quantization == "fp8" and device.type == "cuda"
    linear_peak = matmul_peak_flops(device, float8=True) if fp8_linears else None
    if args.num_loras:
        from kvserve.benchmarks.lora_throughput import run_lora_comparison

        result = run_lora_comparison(engine_args, lambda vocab_size: make_requests(
            args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab_size, args.workload_seed),
            args.num_loras, args.lora_rank)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    llm = LLM(**vars(engine_args))
    engine = llm.engine
    requests = make_requests(
        args.num_prompts, tuple(args.input_len), tuple(args.output_len),
        engine.model_config.vocab_size, args.workload_seed,
    )
    # Warm up allocator and kernels so the first measured run is not penalised.
    llm.generate({"prompt_token_ids": requests[0].prompt_token_ids[:16]},
                 SamplingParams(temperature=0.0, max_tokens=4))
    results = [run_kvserve_batched(llm, requests)]
    floor = _offline_floor(llm, requests, *ceilings, linear_peak)
    if args.sequential:
        results.append(run_kvserve_sequential(llm, requests))
    if args.transformers:
        if engine_args.load_format == "dummy":
            print("transformers baseline skipped: dummy weights")
        else:
            from kvserve.model_executor.default_model import default_model_path

            path = engine_args.model or default_model_path()
            del llm, engine
            results.append(run_transformers_sequential(path, requests, engine_args.resolved_device()))

    print(f"\n{'run':40s} {'requests':>8s} {'time s':>8s} {'out tok/s':>10s} {'total tok/s':>12s}")
    for r in results:
        print(f"{r.name:40s} {r.num_requests:8d} {r.elapsed_s:8.1f} {r.output_tok_s:10.1f} {r.total_tok_s:12.1f}")
    if len(results) > 1:
        print(f"continuous batching vs one at a time: {results[0].output_tok_s / results[1].output_tok_s:.2f}x")
    print(f"floor: {floor['floor_s']:.2f} s = {floor['floor_output_tok_s']:.0f} out tok/s at "
          f"{floor['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s and {floor['peak_flops'] / 1e9:.0f} "
          f"GFLOP/s ({floor['linear_peak_flops'] / 1e9:.0f} for the linears) measured here; "
          f"continuous batching reaches {floor['floor_s'] / results[0].elapsed_s:.0%} of it")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"floor": floor, "results": [
                asdict(r) | {"output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s}
                for r in results]}, f, indent=2)
    return 0


def _offline_floor(
    llm: LLM, requests: list[BenchRequest], bandwidth: float, peak: float, linear_peak: float | None
) -> dict[str, float]:
    """W1's floor for these requests, from the bandwidth and matmul rates measured here, with
    the KV cache's own dtype."""
    engine = llm.engine
    floor_s = offline_floor_s(
        [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests],
        engine.model_config, engine.client.info.decode_weight_bytes,
        bandwidth, peak, engine.client.info.kv_cache_dtype, linear_peak, engine.client.info.expert_weight_bytes,
    )
    return {"floor_s": floor_s, "floor_output_tok_s": sum(r.output_len for r in requests) / floor_s,
            "bandwidth_bytes_per_s": bandwidth, "peak_flops": peak, "linear_peak_flops": linear_peak or peak}
