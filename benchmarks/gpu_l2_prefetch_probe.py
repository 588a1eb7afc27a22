"""What an L2 prefetch of a linear's weights, issued by the latency-bound kernel before it,
saves at one row: for llama3-8b's int4 g128 and fp8 linears, a CUDA graph of pairs [a
kernel of 64 programs that stays busy for T us, as the decode attention does; the linear's
kvserve kernel], over weight copies (>= 256 MB, so nothing is left in L2 from the pair
before), with and without that first kernel hinting the linear's first `--prefetch-mb` MB
into L2 (`prefetch.global.L2`, one a 128-byte line), and with one weight read by every
pair (all in L2: the bound). BENCHMARKS.md, fourteenth session: not worth a kernel change.

    python benchmarks/gpu_l2_prefetch_probe.py [--formats int4,fp8] [--busy-us 0,3,6]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from gpu_one_row_configs import MIN_BYTES, SHAPES, graph_us, weights
from kvserve.quantization.weight_only import weight_only_matmul


@triton.jit
def prefetch_l2(base_ptr, nbytes, part, parts, LINES: tl.constexpr):
    """Hint part `part` of `parts` of the bytes [base_ptr, base_ptr + nbytes) into L2, a
    contiguous run of 128-byte lines, LINES hints at a time (one a thread); nothing waits."""
    lines = tl.cdiv(nbytes, 128)
    per_part = tl.cdiv(lines, parts)
    first = part * per_part
    last = tl.minimum(first + per_part, lines)
    base = base_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    for start in range(first, last, LINES):
        line = tl.minimum(start + tl.arange(0, LINES), last - 1)  # a hint has no mask
        address = (base + line.to(tl.int64) * 128).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [address],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([1], tl.int32)],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _busy_kernel(base_ptr, nbytes, busy_ns, PREFETCH: tl.constexpr):
    start = _now()
    if PREFETCH:
        prefetch_l2(base_ptr, nbytes, tl.program_id(0), tl.num_programs(0), 128)
    while tl.max(_now() - start) < busy_ns:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="int4,fp8", help="Comma-separated: int4, fp8.")
    parser.add_argument("--busy-us", default="0,3,6", help="Comma-separated busy times of the first kernel.")
    parser.add_argument("--prefetch-mb", type=float, default=24.0, help="Most MB of a weight hinted.")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "one row; us a pair (busy kernel + linear), CUDA graph over copies")
    for fmt in args.formats.split(","):
        for name, (n, k) in SHAPES.items():
            nbytes = n * k // (2 if fmt == "int4" else 1)
            stored = weights(fmt, n, k, max(2, -(-MIN_BYTES // nbytes)))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            hinted = min(nbytes, int(args.prefetch_mb * 1e6))
            for busy_us in (float(b) for b in args.busy_us.split(",")):
                def pair(stored_weight, prefetch: bool):
                    q, scale, offset, group, four_bit = stored_weight
                    _busy_kernel[(64,)](q, hinted, int(busy_us * 1e3), PREFETCH=prefetch, num_warps=4)
                    weight_only_matmul(x, q, scale, offset, group, four_bit)
                cold = graph_us([lambda s=s: pair(s, False) for s in stored])
                hint = graph_us([lambda s=s: pair(s, True) for s in stored])
                hot = graph_us([lambda: pair(stored[0], False) for _ in stored])
                busy = graph_us([lambda s=s: _busy_kernel[(64,)](s[0], hinted, int(busy_us * 1e3), PREFETCH=False,
                                                                  num_warps=4) for s in stored])
                print(f"{fmt} {name} ({nbytes / 1e6:.1f} MB, {hinted / 1e6:.1f} hinted) busy {busy_us:.0f} us "
                      f"(alone {busy:.2f}): cold {cold:.2f}, hinted {hint:.2f} ({cold - hint:+.2f}), "
                      f"all in L2 {hot:.2f}", flush=True)
            del stored


if __name__ == "__main__":
    main()
