"""The tensor-core (mma.sync) int4 GEMV against the production kernels: correctness against
an fp32 reference on odd shapes, then llama3-8b's linears at 1-8 rows, each call on its own
weight copy (nothing from L2), inside a CUDA graph. GPU only."""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import int4_mma  # noqa: E402

from kvserve.quantization import triton_kernels as tk  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 8


def mma_matmul(x, q, scale, offset, group_size, warps=4, row_tiles=2, waves=2, pdl=True):
    m, k = x.shape
    n = q.shape[0]
    words = q.view(torch.int32)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    num_tiles = k // 256
    grid_n = triton.cdiv(n, 16 * row_tiles * warps)
    config = tk.LaunchConfig(8, 16 * row_tiles * warps, 256, num_warps=warps, waves=waves)
    split, tiles_per_split = tk._split_k(config, num_tiles, grid_n, x.device)
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    fp16 = x.dtype == torch.float16
    int4_mma._int4_mma_kernel[(grid_n, 1, split)](
        x, words, scale, offset if offset is not None else scale, partial, out, tk._split_counters(x.device),
        m, n, num_tiles, tiles_per_split, group_size, 0x64006400 if fp16 else 0x43004300,
        x.stride(0), words.stride(0), scale.stride(0), m * n, n,
        FP16=fp16, HAS_OFFSET=offset is not None, SPLIT=split > 1, NUM_WARPS=warps, ROW_TILES=row_tiles,
        PDL=pdl, num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}),
    )
    return out


def dequantized(q, scale, offset, group_size):
    low, high = (q & 15).float(), (q >> 4).float()
    values = torch.stack((low, high), dim=-1).reshape(q.shape[0], -1)
    groups = values.view(q.shape[0], -1, group_size)
    w = groups * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return w.reshape(q.shape[0], -1)


def check(device) -> bool:
    ok = True
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for m, n, k, group, has_offset, row_tiles, warps in (
            (1, 200, 512, 128, True, 2, 4), (3, 200, 512, 128, True, 1, 4), (8, 96, 1024, 256, False, 2, 4),
            (5, 1000, 2048, 2048, True, 4, 4), (1, 4096, 4096, 128, True, 2, 8), (2, 64, 256, 128, False, 1, 2),
        ):
            x = torch.randn(m, k, device=device, dtype=dtype)
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
            scale = torch.rand(n, k // group, device=device) * 0.02
            offset = (-8 * scale + torch.randn_like(scale) * 0.01) if has_offset else None
            reference = x.float() @ dequantized(q, scale, offset, group).T
            for pdl in (False, True):
                out = mma_matmul(x, q, scale, offset, group, warps=warps, row_tiles=row_tiles, pdl=pdl)
                err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                good = err < 8e-3
                ok &= good
                print(f"check {str(dtype):15s} m={m} n={n} k={k} g={group} offset={has_offset} R={row_tiles} "
                      f"w={warps} pdl={pdl}: max rel err {err:.1e} {'OK' if good else 'WRONG'}", flush=True)
    return ok


def time_graph(fn, repeats: int = 20) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


VARIANTS = {  # warps, row tiles, waves
    "mma w4 R1": (4, 1, 2), "mma w4 R2": (4, 2, 2), "mma w4 R2 wv4": (4, 2, 4), "mma w8 R2": (8, 2, 2),
    "mma w4 R4": (4, 4, 2), "mma w2 R2 wv4": (2, 2, 4),
}


def main() -> None:
    device = torch.device("cuda")
    if not check(device):
        print("mma kernel WRONG: no timings")
        return
    torch.manual_seed(0)
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / (time_graph(lambda: dst.copy_(src), repeats=10) * 1e-6)
    del src, dst
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for rows in (1, 4, 8):
        names = ["prod"] + list(VARIANTS)
        totals = {name: 0.0 for name in names}
        floor_total = 0.0
        for shape, (n, k) in SHAPES.items():
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            qs = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device) for _ in range(COPIES)]
            scales = [torch.rand(n, k // 128, device=device) * 0.02 for _ in range(COPIES)]
            offsets = [-8 * s for s in scales]
            reference = x.float() @ dequantized(qs[0], scales[0], offsets[0], 128).T
            out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
            floor_us = (n * k // 2 + 8 * n * k // 128) / bandwidth * 1e6
            floor_total += floor_us
            line = [f"rows {rows} {shape:8s} {n}x{k} floor {floor_us:6.1f} us"]
            for name in names:
                if name == "prod":
                    def one(i):
                        out.copy_(tk.weight_only_matmul(x, qs[i], scales[i], offsets[i], 128, four_bit=True))
                else:
                    warps, row_tiles, waves = VARIANTS[name]

                    def one(i, warps=warps, row_tiles=row_tiles, waves=waves):
                        out.copy_(mma_matmul(x, qs[i], scales[i], offsets[i], 128, warps, row_tiles, waves))
                one(0)
                torch.cuda.synchronize()
                err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                us = time_graph(lambda: [one(i) for i in range(COPIES)]) / COPIES
                totals[name] += us
                line.append(f"{name:14s} {us:6.1f} us ({floor_us / us:4.0%}) err {err:.1e}")
            print("\n  ".join(line), flush=True)
        print(f"rows {rows}: one llama3-8b step's linears (x32), floor {32 * floor_total / 1e3:.2f} ms:")
        for name, us in totals.items():
            print(f"  {name:14s} {32 * us / 1e3:.2f} ms ({floor_total / us:.0%} of floor)", flush=True)


if __name__ == "__main__":
    main()
