"""W2-like decode attention (llama3-8b heads, batch 1) at 128-256 keys: 32 layers' calls in one
CUDA graph, forced KV split counts and tiles, each checked against the unsplit default."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
from gpu_decode_tile_sweep import LAYERS, step_us  # noqa: E402

from kvserve.attention.triton_kernels.bench_decode import make_batch  # noqa: E402
from kvserve.attention.triton_kernels.paged_attention import DECODE_TILE, TileConfig, paged_attention  # noqa: E402

torch.manual_seed(0)
for context in (128, 192, 256):
    layers = [make_batch(1, context, 1) for _ in range(LAYERS)]
    outputs = [torch.empty_like(q) for q, *_ in layers]
    scale = layers[0][0].shape[-1] ** -0.5
    reference = []
    for (q, _, _, cache, metadata), out in zip(layers, outputs):
        paged_attention(q, cache, metadata, scale, out, 1, tile=DECODE_TILE)
        reference.append(out.clone())
    for tile in (DECODE_TILE, TileConfig(16, 128, 4, 2), TileConfig(16, 64, 4, 2), TileConfig(16, 32, 4, 1)):
        for splits in (1, 2, 4, 8):
            if splits > 1 and context // splits < 16:
                continue
            def calls(tile=tile, splits=splits):
                for (q, _, _, cache, metadata), out in zip(layers, outputs):
                    paged_attention(q, cache, metadata, scale, out, splits, tile=tile)
            calls()
            error = max((out.float() - ref.float()).abs().max().item() for out, ref in zip(outputs, reference))
            print(f"context {context} tile {tile.block_n}x{tile.num_warps}w{tile.num_stages}s splits {splits}: "
                  f"{step_us(calls):.1f} us a step (max diff {error:.1e})", flush=True)
