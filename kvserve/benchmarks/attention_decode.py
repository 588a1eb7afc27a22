"""Decode (and one prefill) attention timing on CUDA against the torch reference and the
bytes-read floor: python -m kvserve.benchmarks.attention_decode [--out FILE]."""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import TorchReferenceBackend
from kvserve.attention.triton_backend import TritonAttentionBackend
from kvserve.ops.attention.paged_attention import (
    TileConfig,
    choose_decode_plan,
    paged_attention,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # llama3-8b, one layer
DTYPE = torch.bfloat16


def median_ms(fn, rep: int = 200) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy of 4 GiB, bytes read plus bytes written per second."""
    src = torch.randn(2**30, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (median_ms(lambda: dst.copy_(src)) * 1e-3)


def make_batch(num_seqs: int, context: int, new_tokens: int):
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    block_tables = torch.randperm(num_blocks, device="cuda").view(num_seqs, blocks_per_seq).int()
    positions = torch.arange(context - new_tokens, context, device="cuda")
    slots = block_tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    starts = [i * new_tokens for i in range(num_seqs + 1)]
    metadata = AttentionMetadata(
        slot_mapping=slots.flatten(),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        block_size=BLOCK_SIZE,
        max_query_len=new_tokens,
        max_seq_len=context,
        query_start_loc_cpu=starts,
        seq_lens_cpu=[context] * num_seqs,
    )
    num_tokens = num_seqs * new_tokens
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k, v = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    return q, k, v, kv_cache, metadata


def bench_decode(num_seqs: int, context: int, bandwidth: float) -> dict:
    q, k, v, kv_cache, metadata = make_batch(num_seqs, context, 1)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
    floor_ms = kv_bytes / bandwidth * 1e3
    out = torch.empty_like(q)
    plan = choose_decode_plan(metadata, NUM_KV_HEADS, kv_cache.dtype, q.device)
    result = {
        "batch": num_seqs,
        "context": context,
        "kv_MB": kv_bytes / 1e6,
        "floor_ms": floor_ms,
        "auto_splits": plan.num_kv_splits,
        "backend_ms": median_ms(lambda: TritonAttentionBackend().forward(q, k, v, kv_cache, metadata, scale)),
        "torch_ref_ms": median_ms(lambda: TorchReferenceBackend().forward(q, k, v, kv_cache, metadata, scale)),
    }
    result["attention_ms"] = median_ms(
        lambda: paged_attention(q, kv_cache, metadata, scale, out, plan.num_kv_splits, plan.tile)
    )
    return result


SWEEP_TILES = [TileConfig(16, n, 4, stages) for n in (32, 64, 128) for stages in (2, 3)]
SWEEP_SPLITS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def sweep_decode(num_seqs: int, context: int, rounds: int = 2) -> dict:
    """Attention-only time of every (splits, tile) pair, best of `rounds` interleaved medians."""
    q, _, _, kv_cache, metadata = make_batch(num_seqs, context, 1)
    out = torch.empty_like(q)
    times: dict[str, float] = {}
    for _ in range(rounds):
        for tile in SWEEP_TILES:
            for splits in SWEEP_SPLITS:
                if splits * 256 > context:
                    continue
                ms = median_ms(
                    lambda s=splits, t=tile: paged_attention(q, kv_cache, metadata, HEAD_DIM**-0.5, out, s, t),
                    rep=50,
                )
                key = f"splits={splits} tile={tuple(tile)}"
                times[key] = min(ms, times.get(key, ms))
    return dict(sorted(times.items(), key=lambda item: item[1]))


PREFILL_SWEEP_TILES = [TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 2),
                       TileConfig(128, 64, 4, 2), TileConfig(128, 128, 8, 2), TileConfig(64, 128, 4, 2)]


def sweep_prefill(num_seqs: int, length: int) -> dict:
    q, _, _, kv_cache, metadata = make_batch(num_seqs, length, length)
    out = torch.empty_like(q)
    times = {
        str(tuple(tile)): median_ms(
            lambda t=tile: paged_attention(q, kv_cache, metadata, HEAD_DIM**-0.5, out, 1, t), rep=50
        )
        for tile in PREFILL_SWEEP_TILES
    }
    return dict(sorted(times.items(), key=lambda item: item[1]))


def bench_prefill(num_seqs: int, length: int) -> dict:
    q, k, v, kv_cache, metadata = make_batch(num_seqs, length, length)
    scale = HEAD_DIM**-0.5
    flops = 4 * num_seqs * NUM_HEADS * HEAD_DIM * length * (length + 1) / 2  # causal QK^T and PV
    triton_ms = median_ms(lambda: TritonAttentionBackend().forward(q, k, v, kv_cache, metadata, scale))
    torch_ms = median_ms(lambda: TorchReferenceBackend().forward(q, k, v, kv_cache, metadata, scale))
    return {"batch": num_seqs, "length": length, "triton_ms": triton_ms, "torch_ref_ms": torch_ms,
            "triton_TFLOPs": flops / triton_ms / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the numbers here as JSON")
    parser.add_argument("--sweep", action="store_true", help="also time (splits, tile) pairs")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    results = {
        "device": torch.cuda.get_device_name(),
        "copy_TBps": bandwidth / 1e12,
        "decode": [bench_decode(64, 2048, bandwidth), bench_decode(1, 32768, bandwidth)],
        "prefill": [bench_prefill(4, 2048)],
    }
    if args.sweep:
        results["sweep"] = {
            f"{b}x{ctx}": sweep_decode(b, ctx) for b, ctx in ((1, 32768), (4, 8192), (16, 4096), (64, 2048))
        }
        results["sweep"]["prefill 4x2048"] = sweep_prefill(4, 2048)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{results['device']}: copy bandwidth {results['copy_TBps']:.2f} TB/s")
    for r in results["decode"]:
        print(
            f"decode batch {r['batch']} x ctx {r['context']}: KV {r['kv_MB']:.0f} MB, floor "
            f"{r['floor_ms'] * 1e3:.1f} us; triton backend {r['backend_ms'] * 1e3:.1f} us "
            f"({r['floor_ms'] / r['backend_ms']:.0%} of floor, splits {r['auto_splits']}); "
            f"torch ref {r['torch_ref_ms'] * 1e3:.1f} us"
        )
        print(f"  attention kernels only {r['attention_ms'] * 1e3:.1f} us")
    for r in results["prefill"]:
        print(
            f"prefill {r['batch']} x {r['length']}: triton {r['triton_ms']:.3f} ms "
            f"({r['triton_TFLOPs']:.0f} TFLOP/s), torch ref {r['torch_ref_ms']:.3f} ms"
        )
    for shape, times in results.get("sweep", {}).items():
        print(f"sweep {shape}, fastest (us):", {k: round(t * 1e3, 1) for k, t in list(times.items())[:6]})


if __name__ == "__main__":
    main()
