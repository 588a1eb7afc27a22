"""Do the small one-row int4 GEMVs (qkv, o) get faster when their weights were prefetched
into L2 while a latency-bound kernel (standing in for attention) ran? GPU only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.quantization import triton_kernels as tk

GROUP, COPIES = 128, 8
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}


@triton.jit
def _l2_prefetch_kernel(ptr, n_bytes, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    offs = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * 128
    p = ptr + offs
    ok = offs < n_bytes
    if EVICT_LAST:
        tl.inline_asm_elementwise("{ .reg .pred q; setp.ne.b32 q, $2, 0; @q prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [p, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("{ .reg .pred q; setp.ne.b32 q, $2, 0; @q prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [p, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, n):
    acc = tl.zeros((32,), dtype=tl.float32) + tl.program_id(0)
    for _ in range(n):
        acc = acc * 0.999999 + 1e-6
    tl.store(out_ptr + tl.program_id(0) * 32 + tl.arange(0, 32), acc)


def prefetch(t: torch.Tensor, evict_last: bool) -> None:
    n = t.numel() * t.element_size()
    lines = 1024
    _l2_prefetch_kernel[(triton.cdiv(n, 128 * lines),)](t.view(torch.uint8), n, LINES=lines, EVICT_LAST=evict_last,
                                                         num_warps=4)


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


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    spin_out = torch.empty(132 * 32, device=device)
    for spin_n in (1500,):
        spin = lambda: _spin_kernel[(32,)](spin_out, spin_n, num_warps=1)  # noqa: E731
        spin_us = time_graph(lambda: [spin() for _ in range(COPIES)]) / COPIES
        print(f"spin kernel alone: {spin_us:.1f} us", flush=True)
        for name, (n, k) in SHAPES.items():
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            qs = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device) for _ in range(COPIES)]
            scales = [torch.rand(n, k // GROUP, device=device) * 0.02 for _ in range(COPIES)]
            offsets = [-8 * s for s in scales]
            out = torch.empty(1, n, device=device, dtype=torch.bfloat16)

            def gemv(i):
                out.copy_(tk.weight_only_matmul(x, qs[i], scales[i], offsets[i], GROUP, four_bit=True))

            cold = time_graph(lambda: [gemv(i) for i in range(COPIES)]) / COPIES
            warm = time_graph(lambda: [gemv(0) for _ in range(COPIES)]) / COPIES
            spin_gemv = time_graph(lambda: [(spin(), gemv(i)) for i in range(COPIES)]) / COPIES
            results = [f"{name}: cold {cold:.1f} us, L2-warm {warm:.1f}, spin+gemv {spin_gemv:.1f}"]
            for evict_last in (False, True):
                def step(i, evict_last=evict_last):
                    prefetch(qs[i], evict_last)
                    prefetch(scales[i], evict_last)
                    prefetch(offsets[i], evict_last)
                    spin()
                    gemv(i)
                pre = time_graph(lambda: [step(i) for i in range(COPIES)]) / COPIES
                results.append(f"prefetch{'(evict_last)' if evict_last else ''}+spin+gemv {pre:.1f}")
            print(", ".join(results), flush=True)


if __name__ == "__main__":
    main()
