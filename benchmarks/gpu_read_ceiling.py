"""What one kernel can read: for each of llama3-8b's int4 g128 linears (packed weights plus
fp32 scales and offsets) or fp8 ones (a byte a weight plus an fp32 scale a row), the time of
a plain streaming read of as many bytes (each program XOR-reduces a contiguous run,
Triton-pipelined loads; the best of a small grid), of a bf16 cuBLAS GEMV of as many bytes,
and of kvserve's kernel for the format at one row. CUDA graphs cycling through >= 256 MB of
copies, as gpu_one_row_configs.py times them.

    python benchmarks/gpu_read_ceiling.py [--format int4|fp8]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from gpu_one_row_configs import MIN_BYTES, SHAPES, graph_us, time_config, weights


@triton.jit
def _read_kernel(ptr, out_ptr, words_per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    base = ptr + tl.program_id(0).to(tl.int64) * words_per_program
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in tl.range(0, words_per_program, BLOCK, num_stages=STAGES):
        acc ^= tl.load(base + start + tl.arange(0, BLOCK), eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


def read_us(nbytes: int) -> tuple[float, str]:
    copies = max(2, -(-MIN_BYTES // nbytes))
    best = (float("inf"), "")
    for programs in (132, 264, 528, 1056):
        for block, warps in ((1024, 4), (2048, 8)):
            words = -(-nbytes // 4 // programs // block) * block  # whole blocks a program
            buffers = [torch.randint(0, 2**31 - 1, (programs * words,), dtype=torch.int32, device="cuda")
                       for _ in range(copies)]
            out = torch.empty(programs * block, dtype=torch.int32, device="cuda")
            for stages in (1, 3, 4):
                calls = [lambda b=b: _read_kernel[(programs,)](b, out, words, BLOCK=block, STAGES=stages,
                                                                 num_warps=warps, num_stages=stages)
                         for b in buffers]
                us = graph_us(calls)
                best = min(best, (us, f"{programs} programs, {block} words a load, {warps} warps, {stages} stages"))
            del buffers
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="int4", choices=("int4", "fp8"), help="The weights' format (default: int4).")
    fmt = parser.parse_args().format
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "us a call (CUDA graph over copies)", flush=True)
    total = {"read": 0.0, "cublas": 0.0, fmt: 0.0}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k // 2 + n * (k // 128) * 8 if fmt == "int4" else n * k + n * 4
        us, how = read_us(nbytes)
        rows = nbytes // (2 * k)
        mats = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(max(2, -(-MIN_BYTES // (rows * k * 2))))]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        cublas = graph_us([lambda m=m: torch.mv(m, x) for m in mats])
        del mats
        stored = weights(fmt, n, k, max(2, -(-MIN_BYTES // nbytes)))
        kernel = time_config(x[None], stored, None)
        print(f"{name}: {nbytes / 1e6:.1f} MB; read {us:.2f} us ({nbytes / us / 1e6:.2f} TB/s; {how}); "
              f"bf16 cuBLAS GEMV of {rows} x {k} {cublas:.2f} us ({nbytes / cublas / 1e6:.2f} TB/s); "
              f"{fmt} {kernel:.2f} us ({nbytes / kernel / 1e6:.2f} TB/s)", flush=True)
        for key, value in (("read", us), ("cublas", cublas), (fmt, kernel)):
            total[key] += value * 32 / 1e3
    print("one step's linears (ms): " + ", ".join(f"{key} {value:.3f}" for key, value in total.items()))


if __name__ == "__main__":
    main()
