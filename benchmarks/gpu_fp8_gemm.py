"""fp8 linears at 65-2048 rows (W1's decode batches and prefill chunks): torch._scaled_mm with
row-wise scales (kvserve's path above 64 rows, after the per-token quantization), with
use_fast_accum, with tensor-wise scales and the row/column scales applied after, a Triton
W8A8 tl.dot kernel, and kvserve's weight-only kernel (bf16 x, the
e4m3 weight upcast in the loop, no activation quantization) over a few tile configs, against
bf16 cuBLAS; llama3-8b shapes, one step's 32 layers.
Each output is checked against the fp64 product of the same fp8 operands; "fp8 err" is what
quantizing x and w to e4m3 costs against the fp64 product of the bf16 operands, the scale
the accumulation errors compare with. GPU only:
python benchmarks/gpu_fp8_gemm.py [--rows 96,128] [--scaled-mm-only]"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from kvserve.quantization.fp8_activation import quantize_per_token
from kvserve.quantization.weight_only import LaunchConfig, weight_only_matmul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32


@triton.jit
def _w8a8_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # the M tiles of one N tile run together: its weights are read once from DRAM
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(b_ptrs, mask=offs_n[:, None] < N, other=0.0, eviction_policy="evict_first")
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
    c = acc * sa[:, None] * sb[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], c.to(tl.bfloat16), mask=mask)


def w8a8(a, sa, b, sb, config):
    bm, bn, bk, warps, stages = config
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _w8a8_kernel[grid](a, b, sa, sb, c, m, n, k, a.stride(0), b.stride(0), c.stride(0),
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return c


CONFIGS = [(64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 128, 8, 4),
           (128, 32, 128, 4, 5), (64, 32, 256, 4, 4), (128, 64, 256, 8, 3), (256, 64, 128, 8, 3)]


WEIGHT_ONLY_CONFIGS = [LaunchConfig(64, 128, 64), LaunchConfig(64, 128, 128), LaunchConfig(128, 128, 64, num_warps=8),
                       LaunchConfig(128, 64, 128), LaunchConfig(64, 64, 128, num_stages=4),
                       LaunchConfig(128, 128, 128, num_warps=8), LaunchConfig(32, 128, 128)]


def us(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="96,128,192,256,512,2048", help="Comma-separated row counts.")
    parser.add_argument("--scaled-mm-only", action="store_true",
                        help="Skip the Triton W8A8 and weight-only kernels' config searches.")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    print(torch.cuda.get_device_name(), "us per call; 'step' = 32 layers' four linears, ms")
    for m in (int(r) for r in args.rows.split(",")):
        totals: dict[str, float] = {}
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            sw = w.float().abs().amax(1, keepdim=True) / 448
            wq = (w.float() / sw).to(torch.float8_e4m3fn)
            xq, sx = quantize_per_token(x)
            ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t()
            exact = x.double() @ w.double().t()
            row = {"fp8 err": (ref - exact).abs().max().item() / exact.abs().max().item()}
            row["bf16 cuBLAS"] = us(lambda: x @ w.t())
            row["per-token quant"] = us(lambda: quantize_per_token(x))
            for fast in (False, True):
                f = lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1),  # noqa: E731
                                             out_dtype=torch.bfloat16, use_fast_accum=fast)
                err = (f().double() - ref).abs().max().item() / ref.abs().max().item()
                row[f"scaled_mm fast_accum={fast}"] = us(f)
                row[f"scaled_mm fast_accum={fast} err"] = err
            # Tensor-wise scales (other cuBLAS kernels than the row-wise ones), the per-token
            # and per-channel scales applied to the bf16 product afterwards.
            one = torch.ones((), device=dev)
            for fast in (False, True):
                f = lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                             use_fast_accum=fast) * sx * sw.view(1, -1)
                row[f"tensor-wise fast_accum={fast} + rescale"] = us(f)
                row[f"tensor-wise fast_accum={fast} + rescale err"] = (
                    (f().double() - ref).abs().max().item() / ref.abs().max().item())
            if args.scaled_mm_only:
                report(m, name, row, "")
                add_step(totals, row)
                continue
            best = None
            for config in CONFIGS:
                try:
                    out = w8a8(xq, sx.view(-1), wq, sw.view(-1), config)
                except Exception as e:  # noqa: BLE001 (out of shared memory)
                    print("  config", config, "failed:", type(e).__name__)
                    continue
                err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
                t = us(lambda: w8a8(xq, sx.view(-1), wq, sw.view(-1), config))
                if best is None or t < best[0]:
                    best = (t, config, err)
            row["triton w8a8 best"] = best[0]
            row["triton w8a8 err"] = best[2]
            wbest = None
            for config in WEIGHT_ONLY_CONFIGS:
                f = lambda: weight_only_matmul(x, wq, sw, None, k, config=config)  # noqa: E731
                weight_exact = x.double() @ (wq.double() * sw.double()).t()
                err = (f().double() - weight_exact).abs().max().item() / weight_exact.abs().max().item()
                t = us(f)
                if wbest is None or t < wbest[0]:
                    wbest = (t, config, err)
            row["weight-only best"] = wbest[0]
            row["weight-only err"] = wbest[2]
            report(m, name, row, f"  best w8a8 {best[1]}  best weight-only {wbest[1]}")
            add_step(totals, row)
        weights = sum(n * k for n, k in SHAPES.values()) * LAYERS
        print(f"m {m:5d} step: " + "  ".join(f"{key} {value:.2f}" for key, value in totals.items())
              + f"  (fp8 weights {weights / 1e9:.2f} GB)", flush=True)


def report(m: int, name: str, row: dict[str, float], suffix: str) -> None:
    print(f"m {m:5d} {name:8s} " + "  ".join(
        f"{key} {value:.2e}" if key.endswith("err") else f"{key} {value:.1f}" for key, value in row.items())
        + suffix, flush=True)


def add_step(totals: dict[str, float], row: dict[str, float]) -> None:
    for key, value in row.items():
        if not key.endswith("err"):
            totals[key] = totals.get(key, 0.0) + value * LAYERS / 1e3


if __name__ == "__main__":
    main()
