"""Narrow decode batches (llama3-8b heads) at 128-4096 keys: 32 layers' attention calls in one
CUDA graph, the engine's choice (tile and KV splits) against small key tiles at every power
of two of splits, each checked against the engine's output."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
from gpu_decode_tile_sweep import LAYERS, step_us  # noqa: E402

from kvserve.attention.triton_kernels.bench_decode import make_batch  # noqa: E402
from kvserve.attention.triton_kernels.paged_attention import (  # noqa: E402
    TileConfig, choose_num_kv_splits, paged_attention)

torch.manual_seed(0)
TILES = (TileConfig(16, 32, 4, 1), TileConfig(16, 64, 4, 2), TileConfig(16, 32, 2, 1))
for num_seqs in (1, 2, 4, 8):
    for context in (128, 192, 256, 512, 1024, 2048, 4096):
        layers = [make_batch(num_seqs, context, 1) for _ in range(LAYERS)]
        outputs = [torch.empty_like(q) for q, *_ in layers]
        scale = layers[0][0].shape[-1] ** -0.5
        engine_splits = choose_num_kv_splits(layers[0][4], layers[0][3].shape[3], torch.device("cuda"))

        def run(tile, splits):
            for (q, _, _, cache, metadata), out in zip(layers, outputs):
                paged_attention(q, cache, metadata, scale, out, splits, tile=tile)

        run(None, engine_splits)
        reference = [out.clone() for out in outputs]
        default = step_us(lambda: run(None, engine_splits))
        timed = []
        for tile in TILES:
            for splits in (1, 2, 4, 8, 16, 32, 64):
                if context // splits < 16:
                    continue
                run(tile, splits)
                error = max((o.float() - r.float()).abs().max().item() for o, r in zip(outputs, reference))
                assert error < 2e-2, (tile, splits, error)
                timed.append((step_us(lambda tile=tile, splits=splits: run(tile, splits)), tile, splits))
        timed.sort(key=lambda entry: entry[0])
        best = ", ".join(f"{t.block_n}x{t.num_warps}w{t.num_stages}s/{s} {us:.1f}" for us, t, s in timed[:4])
        print(f"batch {num_seqs} context {context}: engine ({engine_splits} splits) {default:.1f} us a step; "
              f"best {best}", flush=True)
