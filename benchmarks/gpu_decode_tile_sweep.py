"""Decode attention tile configs at W2-like shapes: llama3-8b's heads, one layer's cache per
call, 32 calls (a step's layers, each on its own cache) captured in one CUDA graph, so the
time is what a decode step pays, launch latency included. Every config's output is checked
against the default tile's. GPU only.

    python benchmarks/gpu_decode_tile_sweep.py
    python benchmarks/gpu_decode_tile_sweep.py --cases 64:192,64:384 --splits 1,2
    python benchmarks/gpu_decode_tile_sweep.py --cases 1:1025,1:2048 --block-n 32,64,256 --splits 8,16,32

--splits also sweeps the KV splits (choose_num_kv_splits' count is always among them), and
the default tile compared against is the one the batch gets (batch_tile).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kvserve.benchmarks.attention_decode import make_batch
from kvserve.ops.attention.paged_attention import (
    TileConfig,
    batch_tile,
    choose_num_kv_splits,
    paged_attention,
)

LAYERS = 32


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(","))


def step_us(calls) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1:192,1:1024,8:192",
                        help="Comma-separated batch:context pairs, each a decode batch of that many sequences "
                             "over that many cached keys (default: 1:192,1:1024,8:192).")
    parser.add_argument("--block-n", default="32,64,128",
                        help="Comma-separated key-tile widths to sweep, each with 2/4/8 warps and 1-3 stages "
                             "(default: 32,64,128).")
    parser.add_argument("--splits", default=None,
                        help="Comma-separated KV split counts to sweep besides the engine's own choice "
                             "(default: the engine's choice only).")
    args = parser.parse_args()
    cases = [_ints(case.replace(":", ",")) for case in args.cases.split(",")]
    splits_swept = _ints(args.splits) if args.splits else ()
    torch.manual_seed(0)
    configs = [TileConfig(16, n, w, s) for n, w, s in itertools.product(_ints(args.block_n), (2, 4, 8), (1, 2, 3))]
    for num_seqs, context in cases:
        layers = [make_batch(num_seqs, context, 1) for _ in range(LAYERS)]
        outputs = [torch.empty_like(q) for q, *_ in layers]
        scale = layers[0][0].shape[-1] ** -0.5
        splits = choose_num_kv_splits(layers[0][4], layers[0][3].shape[3], torch.device("cuda"))  # as for the default tile
        default_tile = batch_tile(layers[0][4], layers[0][0].dtype, None)
        reference = []
        for (q, _, _, cache, metadata), out in zip(layers, outputs):
            paged_attention(q, cache, metadata, scale, out, splits, tile=default_tile)
            reference.append(out.clone())
        results = []
        split_counts = sorted({*splits_swept, splits})
        for tile, tile_splits in itertools.product(configs + [default_tile], split_counts):
            def calls(tile=tile, tile_splits=tile_splits):
                for (q, _, _, cache, metadata), out in zip(layers, outputs):
                    paged_attention(q, cache, metadata, scale, out, tile_splits, tile=tile)
            try:
                calls()
                torch.cuda.synchronize()
            except Exception as error:  # a tile that does not fit shared memory
                print(f"  {tile}: {type(error).__name__}", flush=True)
                continue
            worst = max((out.float() - ref.float()).abs().max().item() for out, ref in zip(outputs, reference))
            results.append((step_us(calls), tile, tile_splits, worst))
        results.sort(key=lambda r: r[0])
        default = next(us for us, tile, tile_splits, _ in results if tile == default_tile and tile_splits == splits)
        print(f"batch {num_seqs}, context {context}, {splits} KV splits: default {default_tile} {default:.1f} us a "
              f"step ({default / LAYERS:.2f} us a layer)", flush=True)
        for us, tile, tile_splits, worst in results[:8]:
            print(f"  {us:7.1f} us  block_n {tile.block_n:3d} warps {tile.num_warps} stages {tile.num_stages} "
                  f"splits {tile_splits}  max |diff| vs default {worst:.1e}", flush=True)


if __name__ == "__main__":
    main()
