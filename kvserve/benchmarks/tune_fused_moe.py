"""Tune the fused mixture-of-experts GEMMs for this GPU: for each token count, time candidate
tiles for the gate/up and the down GEMM on random weights in the model's shape, check the
winner against a torch reference, and write the fastest into the device's config file, which
`kvserve.ops.fused_moe` loads (entries for other shapes in the file are kept).

    python -m kvserve.benchmarks.tune_fused_moe --model-shape mixtral-8x7b qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import multiprocessing
import os
import json
import sys
import time
from pathlib import Path

import torch

from kvserve.benchmarks.quantized_linears import time_calls
from kvserve.model_executor.dummy import dummy_model_config, dummy_shapes
from kvserve.ops.elementwise import silu_and_mul
from kvserve.ops.expert_weights import ExpertWeights, weight_format
from kvserve.ops.fused_moe import align_by_expert, fused_experts, grouped_gemm
from kvserve.ops.fused_moe_configs import GemmTile, MoEConfig, device_file, shape_key
from kvserve.quantization.fp8 import quantize_fp8
from kvserve.quantization.int4 import dequantize_int4, quantize_int4

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ROUTINGS = 4
INT4_GROUP = 128
SHARED_MEMORY_BYTES = 227 * 1024  # Hopper's per-block limit; smaller tiles fit everywhere


def block_m_candidates(tokens: int, top_k: int, experts: int) -> list[int]:
    """Tiles no taller than twice the rows an expert gets on average (taller ones multiply
    padding), and always 16."""
    rows_per_expert = tokens * top_k / experts
    return [m for m in (16, 32, 64, 128) if m == 16 or m <= 2 * rows_per_expert]


def tile_candidates(block_m: int, element_bytes: int, quantization: str = "none") -> list[GemmTile]:
    """Tiles to time; int4 tiles stay within one 128-wide group (the kernel would cut them)."""
    narrow = block_m <= 32
    tiles = []
    for block_n, block_k, warps, stages in itertools.product(
            (16, 32, 64, 128) if narrow else (64, 128, 256), (128, 256, 512) if narrow else (64, 128),
            (4,) if narrow else (4, 8), (3, 4, 5) if narrow else (3, 4)):
        if (block_m * block_k + block_k * block_n) * element_bytes * stages > SHARED_MEMORY_BYTES:
            continue
        if warps == 8 and block_m * block_n < 64 * 64:
            continue  # too little work per warp
        if quantization == "int4" and block_k > INT4_GROUP:
            continue
        tiles.append(GemmTile(block_n, block_k, warps, stages))
    return tiles


def _compile(args: tuple) -> None:
    """Launch one tile once on a one-expert problem of the real widths and format, so
    Triton's on-disk cache holds its binary (run in a worker process: compiles then proceed
    in parallel)."""
    block_m, tile, dtype_name, quantization, n, k, rows_per_a, scale = args
    dtype = getattr(torch, dtype_name)
    a = torch.zeros(rows_per_a, k, device="cuda", dtype=dtype)
    b, _ = random_experts(1, n, k, quantization, dtype, torch.Generator(device="cuda"))
    out = torch.empty(rows_per_a, n, device="cuda", dtype=dtype)
    chosen = torch.zeros(1, rows_per_a, dtype=torch.int64, device="cuda")
    weights = torch.ones(rows_per_a, device="cuda")
    grouped_gemm(a, b, out, weights, *align_by_expert(chosen, 1, block_m), rows_per_a, scale, block_m, tile)
    torch.cuda.synchronize()


def precompile(jobs: list[tuple], workers: int) -> None:
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, outcome in zip(jobs, pool.map(_compile_quietly, jobs)):
            if outcome:
                print(f"  cannot compile {job[:2]}: {outcome}", file=sys.stderr)


def _compile_quietly(args: tuple) -> str | None:
    try:
        _compile(args)
    except Exception as error:  # a tile this GPU cannot run (resources): the timing skips it
        return f"{type(error).__name__}: {str(error)[:200]}"
    return None


def reference(x, chosen, weights, w13, w2) -> torch.Tensor:
    """Each expert on its tokens with torch matmuls in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in chosen.unique().tolist():
        token, slot = (chosen == expert).nonzero(as_tuple=True)
        gate, up = (x[token].float() @ w13[expert].float().T).chunk(2, dim=-1)
        out.index_add_(0, token, weights[token, slot, None] * ((torch.nn.functional.silu(gate) * up)
                                                             @ w2[expert].float().T))
    return out


def random_experts(experts: int, n: int, k: int, quantization: str, dtype: torch.dtype,
                   generator: torch.Generator) -> tuple[ExpertWeights, torch.Tensor]:
    """Random expert weights [E, N, K] in the format kvserve's quantizers give a checkpoint's
    experts (none, int4 with 128-wide groups, fp8 per channel), and their values as the
    kernel should use them (the reference's)."""
    dense = torch.randn(experts, n, k, device="cuda", dtype=torch.float32, generator=generator) / k**0.5
    if quantization == "none":
        return ExpertWeights(dense.to(dtype)), dense.to(dtype)
    stored, scales, offsets = [], [], []
    for index, w in enumerate(dense):
        if quantization == "int4":
            q, scale, minimum = quantize_int4(w, INT4_GROUP)
            stored.append(q[:, 0::2] | (q[:, 1::2] << 4))
            offsets.append(minimum.half())
            dense[index] = dequantize_int4(q, scale.half(), minimum.half())
            scale = scale.half()
        else:
            q, scale = quantize_fp8(w)
            scale = scale[:, None]
            stored.append(q)
            dense[index] = q.float() * scale
        scales.append(scale)
    weights = ExpertWeights(torch.stack(stored), torch.stack(scales), torch.stack(offsets) if offsets else None,
                            INT4_GROUP if quantization == "int4" else k, quantization == "int4")
    return weights, dense


def tune_shape(experts: int, hidden: int, intermediate: int, top_k: int, dtype: torch.dtype,
               quantization: str, token_counts: list[int], workers: int) -> dict[int, MoEConfig]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13, dense13 = random_experts(experts, 2 * intermediate, hidden, quantization, dtype, generator)
    w2, dense2 = random_experts(experts, hidden, intermediate, quantization, dtype, generator)
    dtype_name = str(dtype).removeprefix("torch.")
    x_bytes = torch.empty(0, dtype=dtype).element_size()
    jobs = {(block_m, tile, dtype_name, quantization, n, k, rows_per_a, scale)
            for tokens in token_counts for block_m in block_m_candidates(tokens, top_k, experts)
            for tile in tile_candidates(block_m, x_bytes, quantization)
            for n, k, rows_per_a, scale in ((2 * intermediate, hidden, top_k, False),
                                            (hidden, intermediate, 1, True))}
    started = time.perf_counter()
    precompile(sorted(jobs, key=str), workers)
    print(f"   compiled {len(jobs)} variants in {time.perf_counter() - started:.0f} s", flush=True)
    best: dict[int, MoEConfig] = {}
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=generator)
        # Several routings, each timed in turn: the experts one reads are cold in L2 for the next.
        routings = []
        for _ in range(ROUTINGS):
            logits = torch.randn(tokens, experts, device="cuda", generator=generator)
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
            routings.append((weights, chosen))
        gate_up = torch.empty(tokens * top_k, 2 * intermediate, device="cuda", dtype=dtype)
        activation = silu_and_mul(gate_up)
        down = torch.empty(tokens * top_k, hidden, device="cuda", dtype=dtype)
        results = []
        for block_m in block_m_candidates(tokens, top_k, experts):
            aligned = [(weights.flatten().contiguous(), align_by_expert(chosen, experts, block_m))
                       for weights, chosen in routings]
            timed = {}
            for name, a, b, out, rows_per_a, scale in (("gate_up", x, w13, gate_up, top_k, False),
                                                       ("down", activation, w2, down, 1, True)):
                candidates = []
                for tile in tile_candidates(block_m, x_bytes, quantization):
                    launches = [functools.partial(grouped_gemm, a, b, out, flat_weights, *alignment,
                                                  rows_per_a, scale, block_m, tile)
                                for flat_weights, alignment in aligned]
                    try:
                        # One graph replays every routing in turn: each reads experts the
                        # previous left cold in L2.
                        candidates.append((time_calls(launches, repeats=2) / 1e3, tile))
                    except Exception as error:  # a tile this GPU cannot run (resources)
                        print(f"  skip {tile}: {type(error).__name__}", file=sys.stderr)
                timed[name] = min(candidates, key=lambda c: c[0])
            total = timed["gate_up"][0] + timed["down"][0]
            results.append((total, MoEConfig(block_m, timed["gate_up"][1], timed["down"][1])))
        total, config = min(results, key=lambda r: r[0])
        weights, chosen = routings[0]
        expected = reference(x, chosen, weights, dense13, dense2)
        got = fused_experts(x, chosen, weights, w13, w2, config).float()
        error = ((got - expected).abs().max() / expected.abs().max()).item()
        if not error < 3e-2:
            raise RuntimeError(f"tokens={tokens}: {config} is wrong (relative error {error:.2e})")
        experts_read = sum(chosen.unique().numel() for _, chosen in routings) / ROUTINGS
        weight_bytes = experts_read * (w13.weight[0].nbytes + w2.weight[0].nbytes)
        print(f"tokens {tokens:5d}: {total * 1e3:8.1f} us, {weight_bytes / total / 1e6:6.0f} GB/s of "
              f"expert weights; {config}", flush=True)
        best[tokens] = config
    return weight_format(w13, dtype), best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", nargs="+", required=True, choices=dummy_shapes(),
                        help="model shapes whose mixture-of-experts layers to tune")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="activation and weight dtype")
    parser.add_argument("--quantization", default="none", choices=["none", "int4", "fp8"],
                        help="expert weight format: as stored, int4 with 128-wide groups, or fp8 per "
                             "output channel (what --quantization int4 / fp8 give a model's experts)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                        help="batch token counts to tune (a launch takes the nearest)")
    parser.add_argument("--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="processes that compile the candidate tiles in parallel")
    parser.add_argument("--output", type=Path, default=None,
                        help="config file to update (default: the package's file for this GPU); entries of "
                             "token counts not tuned now are kept")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    path = args.output or device_file(torch.cuda.get_device_name())
    tuned = json.loads(path.read_text()) if path.exists() else {}
    for shape in args.model_shape:
        config = dummy_model_config(shape)
        if not config.num_experts:
            parser.error(f"{shape} has no mixture-of-experts layers")
        started = time.perf_counter()
        print(f"== {shape}: E={config.num_experts} H={config.hidden_size} I={config.moe_intermediate_size} "
              f"top_k={config.num_experts_per_tok} {args.dtype}, experts {args.quantization} on "
              f"{torch.cuda.get_device_name()}", flush=True)
        fmt, best = tune_shape(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                               config.num_experts_per_tok, dtype, args.quantization, args.tokens,
                               args.compile_workers)
        key = shape_key(config.num_experts, config.hidden_size, config.moe_intermediate_size, fmt)
        entries = {**tuned.get(key, {}), **{str(tokens): config.to_json() for tokens, config in best.items()}}
        tuned[key] = dict(sorted(entries.items(), key=lambda item: int(item[0])))
        print(f"   tuned in {time.perf_counter() - started:.0f} s", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(sorted(tuned.items())), indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
