"""Probe: the one-row int4 GEMV with its weight tiles brought in by TMA (a tensor descriptor
over the int32 words) and pipelined by Triton num_stages deep through shared memory, against
the default kernels; llama3-8b's linears in CUDA graphs over >= 256 MB of weight copies.

    python benchmarks/gpu_tma_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gpu_one_row_configs import MIN_BYTES, SHAPES, graph_us, time_config, weights
from triton.tools.tensor_descriptor import TensorDescriptor

from kvserve.quantization.weight_only import LaunchConfig
from kvserve.quantization.weight_only.matmul import split_counters, split_k, weight_only_matmul
from kvserve.quantization.weight_only.tiles import group_scale_offset, nibble, split_tiles, store_output


@triton.jit
def _int4_tma_kernel(
    x_ptr, w_desc, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    N, num_tiles, tiles_per_split, one_bits, stride_sn, stride_ps,
    BLOCK_N: tl.constexpr, WORDS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
):
    col0 = tl.program_id(0) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    first, last = split_tiles(num_tiles, tiles_per_split, False)
    words = tl.arange(0, WORDS)
    second_half = (words >= WORDS // 2)[None, :]
    x_words = x_ptr.to(tl.pointer_type(tl.int32)) + 4 * words  # bf16 pairs: 8 values a weight word
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for tile in tl.range(first, last, num_stages=STAGES):
        w = w_desc.load([col0, tile * WORDS])
        f_x = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((WORDS,), dtype=tl.float32)
        for pair in tl.static_range(4):
            x_pair = tl.load(x_words + tile * (4 * WORDS) + pair)
            x_even = (x_pair << 16).to(tl.float32, bitcast=True)
            x_odd = (x_pair & -65536).to(tl.float32, bitcast=True)
            f_x += nibble(w, 2 * pair, one_bits) * x_even[None, :]
            f_x += nibble(w, 2 * pair + 1, one_bits) * x_odd[None, :]
            x_sum += x_even + x_odd
        group = 2 * tile
        scale, offset = group_scale_offset(scale_ptr + cols * stride_sn, offset_ptr + cols * stride_sn, group,
                                               col_mask, True)
        scale2, offset2 = group_scale_offset(scale_ptr + cols * stride_sn, offset_ptr + cols * stride_sn,
                                                 group + 1, col_mask, True)
        acc += (f_x * tl.where(second_half, scale2[:, None], scale[:, None])
                + x_sum[None, :] * tl.where(second_half, offset2[:, None], offset[:, None]))
    y = tl.sum(acc, axis=1)
    store_output((y,), (cols,), (col_mask,), partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT)


def tma_matmul(x, words, desc, scale, offset, block_n, stages, waves, warps=4):
    n = words.shape[0]
    num_tiles = words.shape[1] // 32
    grid_n = triton.cdiv(n, block_n)
    split, tiles_per_split = split_k(LaunchConfig(1, block_n, 256, waves=waves), num_tiles, grid_n, x.device)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((split, 1, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _int4_tma_kernel[(grid_n, 1, split)](
        x, desc, scale, offset, partial, out, split_counters(x.device), n, num_tiles, tiles_per_split,
        0x3F800000, scale.stride(0), n, BLOCK_N=block_n, WORDS=32, SPLIT=split > 1, STAGES=stages,
        num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "int4 one row, us a call (CUDA graph over weight copies)", flush=True)
    for name, (n, k) in SHAPES.items():
        nbytes = n * k // 2
        stored = weights("int4", n, k, max(2, -(-MIN_BYTES // nbytes)))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        q, scale, offset, group, _ = stored[0]
        reference = weight_only_matmul(x, q, scale, offset, group, True).float()
        print(f"{name} ({n} x {k}): default {time_config(x, stored, None):.2f} us", flush=True)
        for block_n in (64, 128):
            descs = [(q.view(torch.int32), TensorDescriptor.from_tensor(q.view(torch.int32), [block_n, 32]), s, o)
                     for q, s, o, _, _ in stored]
            for stages in (2, 3, 4, 6):
                for waves in (1, 2, 4):
                    try:
                        y = tma_matmul(x, *descs[0], block_n, stages, waves).float()
                    except Exception as error:  # shared memory, say
                        print(f"   block_n {block_n} stages {stages} waves {waves}: {type(error).__name__}", flush=True)
                        continue
                    error = ((y - reference).abs().max() / reference.abs().max()).item()

                    us = graph_us([lambda args=args: tma_matmul(x, *args, block_n, stages, waves) for args in descs])
                    print(f"  {us:7.2f}  tma block_n {block_n} stages {stages} waves {waves} (err {error:.1e})",
                          flush=True)


if __name__ == "__main__":
    main()
