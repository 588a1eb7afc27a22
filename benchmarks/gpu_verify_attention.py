"""A speculative verify step's attention at W2-like shapes: llama3-8b's heads, 1 + k query
tokens a sequence, a step's 32 layers (each on its own cache and q/k/v) in one CUDA graph, so
the time is what a verify step pays, launch latency included.

* "rotate first": what verify steps ran before the short-context plan took them: the RoPE
  kernel, the KV-cache write, then the prefill tile over choose_num_kv_splits' splits;
  "attention only" is that last kernel alone.
* "short, fused": TritonAttentionBackend as the model calls it (RoPE's cos and sin handed
  over), on the plan choose_decode_plan gives the batch; other SHORT_TILES (warps, keys a
  tile) are timed by swapping the module's SHORT_DECODE_TILE.

    python benchmarks/gpu_verify_attention.py      # CASES=batch:context:width,...
    CASES=1:2048:1 SPLITS=8,16,32 TILES=32:4 python benchmarks/gpu_verify_attention.py

SPLITS times the short tiles at those split counts too (past SHORT_CONTEXT, where
choose_decode_plan gives the default tile, only SPLITS' counts are short); TILES picks
SHORT_TILES by keys a tile and warps.

Every output is checked against the "rotate first" path's.
"""

from __future__ import annotations

import itertools
import os

import torch

from gpu_decode_tile_sweep import step_us  # benchmarks/ is the script's directory
from kvserve.attention import triton_backend
from kvserve.attention.triton_kernels import paged_attention as pa
from kvserve.attention.triton_kernels.bench_decode import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, make_batch
from kvserve.attention.triton_kernels.kv_cache_write import write_kv_cache
from kvserve.model_executor.layers.rotary import RotaryEmbedding
from kvserve.model_executor.layers.triton_ops import rotary_queries_and_keys_

LAYERS = 32
CASES = tuple(tuple(int(v) for v in case.split(":"))
              for case in os.environ.get("CASES", "1:256:5,1:256:9,1:1024:5,2:256:5,1:128:5").split(","))
SHORT_TILES = [pa.TileConfig(16, int(n), int(w), 1)
               for n, w in (tile.split(":") for tile in os.environ.get("TILES", "32:4,32:8,64:4,64:8").split(","))]
SPLITS = tuple(int(n) for n in os.environ["SPLITS"].split(",")) if os.environ.get("SPLITS") else ()


def layer_inputs(num_seqs: int, context: int, width: int):
    """q, k, v as views of one q/k/v buffer (the model's layout), the cache, metadata, and
    RoPE's cos and sin at the new tokens' positions."""
    q, k, v, cache, metadata = make_batch(num_seqs, context, width)
    q, k, v = torch.cat([q, k, v], dim=1).split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    positions = torch.arange(context - width, context, device="cuda").repeat(num_seqs)
    cos, sin = RotaryEmbedding(HEAD_DIM, 500000.0, None).cos_sin(positions.cpu())
    return q, k, v, cache, metadata, cos.cuda(), sin.cuda()


def main() -> None:
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    for num_seqs, context, width in CASES:
        layers = [layer_inputs(num_seqs, context, width) for _ in range(LAYERS)]
        outputs = [torch.empty_like(layer[0]) for layer in layers]
        old_splits = pa.choose_num_kv_splits(layers[0][4], NUM_KV_HEADS, torch.device("cuda"))
        plan = pa.choose_decode_plan(layers[0][4], NUM_KV_HEADS, torch.bfloat16, torch.device("cuda"))
        pristine = [(q.clone(), k.clone(), cache.clone()) for q, k, _, cache, *_ in layers]

        def restore() -> None:
            for (q, k, _, cache, *_), (q0, k0, cache0) in zip(layers, pristine):
                q.copy_(q0), k.copy_(k0), cache.copy_(cache0)

        def rotate_first(attention=True, rotate=True):
            for (q, k, v, cache, metadata, cos, sin), out in zip(layers, outputs):
                if rotate:
                    rotary_queries_and_keys_(q, k, cos, sin)
                    write_kv_cache(k, v, cache, metadata.slot_mapping, (1.0, 1.0))
                if attention:
                    pa.paged_attention(q, cache, metadata, scale, out, old_splits)

        restore()
        rotate_first()
        reference = [out.clone() for out in outputs]
        results = [("rotate first", old_splits, step_us(rotate_first)),
                   ("attention only (prefill tile)", old_splits, step_us(lambda: rotate_first(rotate=False))),
                   ("RoPE + KV write only", old_splits, step_us(lambda: rotate_first(attention=False)))]
        default_tile = pa.SHORT_DECODE_TILE
        short_splits = sorted({*SPLITS, plan.num_kv_splits} if plan.tile is not None else set(SPLITS))
        for tile, splits in itertools.product(SHORT_TILES, short_splits):
            pa.SHORT_DECODE_TILE, pa.NARROW_DECODE_TILES = tile, (pa.DECODE_TILE, tile)
            tile_plan = pa.DecodePlan(splits, tile)
            backend = triton_backend.TritonAttentionBackend()
            new_outputs: list[torch.Tensor] = []

            def fused(backend=backend, tile_plan=tile_plan, new_outputs=new_outputs):
                new_outputs.clear()
                for q, k, v, cache, metadata, cos, sin in layers:
                    metadata.decode_plan = tile_plan
                    new_outputs.append(backend.forward(q, k, v, cache, metadata, scale, rotary=(cos, sin)))

            restore()
            fused()
            worst = max((new.float() - ref.float()).abs().max().item() for new, ref in zip(new_outputs, reference))
            label = f"short, fused: block_n {tile.block_n} warps {tile.num_warps}"
            results.append((f"{label} (max |diff| {worst:.1e})", splits, step_us(fused)))
        pa.SHORT_DECODE_TILE, pa.NARROW_DECODE_TILES = default_tile, (pa.DECODE_TILE, default_tile)
        print(f"batch {num_seqs}, context {context}, width {width} ({LAYERS} layers a graph):", flush=True)
        for label, splits, us in results:
            print(f"  {us:7.1f} us  {us / LAYERS:6.2f} a layer  splits {splits:2d}  {label}", flush=True)


if __name__ == "__main__":
    main()
