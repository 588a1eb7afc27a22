"""One-row int4 GEMV variants against the production kernel: llama3-8b's four linears, each
call on a different copy of the weight (nothing from L2), inside a CUDA graph; every variant
checked against an fp32 reference. GPU: python benchmarks/experiments/int4_gemv_bench.py
CPU (interpreter, correctness only): TRITON_INTERPRET=1 python ... --check"""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.triton_interpreter import patch_interpreter
    patch_interpreter()
import int4_gemv_variants as variants  # noqa: E402

from kvserve.quantization import triton_kernels as tk  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP, BLOCK_K, COPIES = 128, 256, 8


def launch_variant(kernel, block_n, warps, waves, x, words, scale, offset, out, partial, pdl):
    n, k = words.shape[0], x.shape[1]
    num_tiles = k // BLOCK_K
    grid_n = triton.cdiv(n, block_n)
    config = tk.LaunchConfig(1, block_n, BLOCK_K, num_warps=warps, num_stages=1, waves=waves, words="fma")
    split, tiles_per_split = tk._split_k(config, num_tiles, grid_n, x.device)
    kernel[(grid_n, 1, split)](
        x, words, scale, offset, partial, out, tk._split_counters(x.device),
        n, num_tiles, tiles_per_split, 1, 0x3F800000, words.stride(0), scale.stride(0), n,
        HAS_OFFSET=True, SPLIT=split > 1, BLOCK_N=block_n, BLOCK_K=BLOCK_K, TWO_GROUPS=True, PDL=pdl,
        num_warps=warps, num_stages=1,
    )


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


VARIANTS = {
    "v3 128x4": (variants._int4_gemv_v3, 128, 4, 2),
    "v4 128x4": (variants._int4_gemv_v4, 128, 4, 2),
    "v4 128x4 w3": (variants._int4_gemv_v4, 128, 4, 3),
    "v4 128x8": (variants._int4_gemv_v4, 128, 8, 2),
    "v4 64x4": (variants._int4_gemv_v4, 64, 4, 2),
    "v4 64x4 w4": (variants._int4_gemv_v4, 64, 4, 4),
    "v4 64x2": (variants._int4_gemv_v4, 64, 2, 4),
    "v4 256x8": (variants._int4_gemv_v4, 256, 8, 2),
}


def dequantized(q, scale, offset):
    low, high = (q & 15).float(), (q >> 4).float()
    values = torch.stack((low, high), dim=-1).reshape(q.shape[0], -1)
    groups = values.view(q.shape[0], -1, GROUP)
    return (groups * scale[:, :, None] + offset[:, :, None]).reshape(q.shape[0], -1)


def check(device: torch.device) -> None:
    """Every variant against the fp32 reference on small odd-N shapes (runs on the interpreter)."""
    torch.manual_seed(0)
    for n, k in ((200, 512), (96, 1024)):
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        scale = torch.rand(n, k // GROUP, device=device) * 0.02
        offset = -8 * scale + torch.randn_like(scale) * 0.01
        reference = x.float() @ dequantized(q, scale, offset).T
        for name, (kernel, block_n, warps, waves) in VARIANTS.items():
            out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
            partial = torch.empty(64, 1, n, device=device, dtype=torch.float32)
            launch_variant(kernel, block_n, warps, waves, x, q.view(torch.int32), scale, offset, out, partial, False)
            err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            print(f"{name:14s} n={n} k={k} max rel err {err:.2e} {'OK' if err < 1e-2 else 'WRONG'}", flush=True)


def main() -> None:
    if "--check" in sys.argv:
        check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return
    torch.manual_seed(0)
    device = torch.device("cuda")
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / (time_graph(lambda: dst.copy_(src), repeats=10) * 1e-6)
    del src, dst
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    check(device)
    names = ["prod"] + list(VARIANTS)
    totals = {name: 0.0 for name in names}
    floor_total = 0.0
    for shape, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        qweights = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device) for _ in range(COPIES)]
        scales = [torch.rand(n, k // GROUP, device=device) * 0.02 for _ in range(COPIES)]
        offsets = [-8 * s for s in scales]
        words = [q.view(torch.int32) for q in qweights]
        reference = (x.float() @ dequantized(qweights[0], scales[0], offsets[0]).T)
        out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        partial = torch.empty(64, 1, n, device=device, dtype=torch.float32)
        floor_us = (n * k // 2 + 2 * 4 * n * k // GROUP) / bandwidth * 1e6
        floor_total += floor_us
        line = [f"{shape:8s} {n}x{k} floor {floor_us:6.1f} us"]
        for name in names:
            if name == "prod":
                def one(i, out=out):
                    out.copy_(tk.weight_only_matmul(x, qweights[i], scales[i], offsets[i], GROUP, four_bit=True))
            else:
                kernel, block_n, warps, waves = VARIANTS[name]

                def one(i, kernel=kernel, block_n=block_n, warps=warps, waves=waves):
                    launch_variant(kernel, block_n, warps, waves, x, words[i], scales[i], offsets[i], out, partial, True)
            one(0)
            torch.cuda.synchronize()
            err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            us = time_graph(lambda: [one(i) for i in range(COPIES)]) / COPIES
            totals[name] += us
            line.append(f"{name:14s} {us:6.1f} us ({floor_us / us:4.0%}) err {err:.1e}")
        print("\n  ".join(line), flush=True)
    print(f"one llama3-8b step's linears (x32), floor {32 * floor_total / 1e3:.2f} ms:")
    for name, us in totals.items():
        print(f"  {name:14s} {32 * us / 1e3:.2f} ms ({floor_total / us:.0%} of floor)")


if __name__ == "__main__":
    main()
