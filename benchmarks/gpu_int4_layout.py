"""Does the one-row int4 kernel read faster when each K tile of a slab of weight rows is
contiguous in memory? (Row-major weights give each program BLOCK_N separate 128-byte runs a
tile; a slab layout [N / S, K / 256, S, 32 words] gives it S * 128 contiguous bytes.)

Times llama3-8b's four linears at one row, each call on a different copy of the weight (so
L2 holds none of it), inside a CUDA graph; checks every variant bit for bit against the
production kernel. Run on the GPU: python benchmarks/gpu_int4_layout.py
"""

from __future__ import annotations

import torch
import triton

from kvserve.quantization import triton_kernels as tk

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP, BLOCK_K, COPIES = 128, 256, 8
CONFIG = tk.default_config(1, four_bit=True, fp8=False)


def launch(x, words, scale, offset, n, slab_rows, evict, out, partial):
    k = x.shape[1]
    num_tiles = k // BLOCK_K
    grid_n = triton.cdiv(n, CONFIG.block_n)
    split, tiles_per_split = tk._split_k(CONFIG, num_tiles, grid_n, x.device)
    if slab_rows == 1:
        stride_wn, stride_wt = words.stride(0), BLOCK_K // 8
    else:
        stride_wn, stride_wt = num_tiles * slab_rows * (BLOCK_K // 8), slab_rows * (BLOCK_K // 8)
    tk._int4_gemv_kernel[(grid_n, 1, split)](
        x, words, scale, offset, partial, out, tk._split_counters(x.device),
        1, n, num_tiles, tiles_per_split, 1, 0x3F800000,
        x.stride(0), stride_wn, scale.stride(0), n, n, stride_wt,
        X_BF16=True, HAS_OFFSET=True, SPLIT=split > 1, BLOCK_M=1, BLOCK_N=CONFIG.block_n, BLOCK_K=BLOCK_K,
        TWO_GROUPS=True, PDL=False, SLAB_ROWS=slab_rows, EVICT=evict,
        num_warps=CONFIG.num_warps, num_stages=CONFIG.num_stages,
    )


def slabs(words: torch.Tensor, slab_rows: int) -> torch.Tensor:
    if slab_rows == 1:
        return words
    n, kw = words.shape
    return words.view(n // slab_rows, slab_rows, kw // 32, 32).permute(0, 2, 1, 3).contiguous()


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
    return start.elapsed_time(end) / repeats * 1e3  # us per replay


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_graph(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() / (us * 1e-6)


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    variants = [(1, ""), (1, "evict_first"), (32, ""), (64, ""), (128, ""), (64, "evict_first"), (128, "evict_first")]
    totals = {v: 0.0 for v in variants}
    floor_total = 0.0
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        qweights = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device) for _ in range(COPIES)]
        scales = [torch.rand(n, k // GROUP, device=device) * 0.02 for _ in range(COPIES)]
        offsets = [-8 * s for s in scales]
        reference = tk.weight_only_matmul(x, qweights[0], scales[0], offsets[0], GROUP, four_bit=True)
        out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        partial = torch.empty(64, 1, n, device=device, dtype=torch.float32)
        stored = n * k // 2 + 2 * 4 * n * k // GROUP
        floor_us = stored / bandwidth * 1e6
        floor_total += floor_us
        line = [f"{name:8s} {n}x{k} floor {floor_us:6.1f} us"]
        for slab_rows, evict in variants:
            words = [slabs(q.view(torch.int32), slab_rows) for q in qweights]
            launch(x, words[0], scales[0], offsets[0], n, slab_rows, evict, out, partial)
            same = torch.equal(out, reference)

            def calls():
                for w, s, o in zip(words, scales, offsets):
                    launch(x, w, s, o, n, slab_rows, evict, out, partial)

            us = time_graph(calls) / COPIES
            totals[(slab_rows, evict)] += us
            line.append(f"slab {slab_rows:3d} {evict or 'normal':11s} {us:6.1f} us ({floor_us / us:4.0%}){'' if same else ' WRONG'}")
            del words
        print("\n  ".join(line), flush=True)
    print(f"one llama3-8b step's linears (x32), floor {32 * floor_total / 1e3:.2f} ms:")
    for (slab_rows, evict), us in totals.items():
        print(f"  slab {slab_rows:3d} {evict or 'normal':11s} {32 * us / 1e3:.2f} ms ({floor_total / us:.0%} of floor)")


if __name__ == "__main__":
    main()
