"""Decode and prefill attention with a bf16 cache and an e4m3 cache (its dots in fp16),
with the default tiles and 128 or 256 keys a decode tile. llama3-8b heads, one layer. GPU only:
python benchmarks/gpu_kv_cache_attention.py"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from kvserve.attention.triton_kernels.bench_decode import HEAD_DIM, make_batch
from kvserve.attention.triton_kernels.paged_attention import (
    DECODE_TILE,
    PREFILL_TILE,
    TileConfig,
    choose_num_kv_splits,
    paged_attention,
)


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    for num_seqs, context, new in ((1, 1024, 1), (8, 1024, 1), (16, 1024, 1), (64, 1024, 1), (256, 1024, 1),
                                   (64, 256, 1), (4, 1024, 512), (1, 2048, 2048)):
        q, _, _, cache, metadata = make_batch(num_seqs, context, new)
        kv_scale = cache.float().abs().amax().item() / 448
        fp8 = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
        splits = choose_num_kv_splits(metadata, cache.shape[3], q.device) if new == 1 else 1
        variants = {
            "bf16 cache": (q, cache, (1.0, 1.0), None),
            "e4m3 cache (default: fp16 dots)": (q, fp8, (kv_scale, kv_scale), None),
        }
        if new == 1:
            variants["bf16 cache, 128-key tiles"] = (q, cache, (1.0, 1.0), TileConfig(16, 128, 4, 2))
            variants["e4m3 cache, 256-key tiles"] = (q, fp8, (kv_scale, kv_scale), TileConfig(16, 256, 8, 2))
            variants["e4m3 cache, 128-key tiles"] = (q, fp8, (kv_scale, kv_scale), TileConfig(16, 128, 4, 2))
        reference = None
        line = [f"seqs {num_seqs} context {context} new {new} (splits {splits}):"]
        for name, (query, kv, scales, tile) in variants.items():
            out = torch.empty_like(query)
            run = lambda: paged_attention(query, kv, metadata, scale, out, splits, tile, scales)  # noqa: E731
            run()
            if reference is None:
                reference = out.float().clone()
            err = (out.float() - reference).abs().max().item()
            line.append(f"{name:32s} {ms(run) * 1e3:8.1f} us  max |diff| vs bf16 cache {err:.3f}")
        print("\n  ".join(line), flush=True)
    print("tiles:", DECODE_TILE, PREFILL_TILE)


if __name__ == "__main__":
    main()
