"""Dynamic per-token fp8 quantization of activations for the fp8 x fp8 matmuls, one Triton
kernel per call: the torch form (abs, amax, divide, clamp, cast) is about seven kernels,
which at prefill sizes cost as much as the fp8 matmul they feed. `quantize_row` is the same
rounding for kernels that quantize their own output (Fp8Rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@triton.jit
def quantize_row(x, FP8_MAX: tl.constexpr):
    """One fp32 row -> (its e4m3 values as uint8 bits, its fp32 scale): the row's absolute
    maximum maps to FP8_MAX. Correctly rounded divisions (Triton's `/` is approximate): the
    same bits as torch's."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), FP8_MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), scale


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    bits, scale = quantize_row(x, FP8_MAX)
    # Stored through uint8 bits (the pointer is a uint8 view of the fp8 output).
    tl.store(q_ptr + row * num_cols + cols, bits, mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (x_fp8 [M, K] float8_e4m3fn, scale fp32 [M, 1])
    with x ~= x_fp8 * scale; each row's absolute maximum maps to the largest e4m3 value."""
    m, k = x.shape
    assert x.stride(-1) == 1
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _per_token_fp8_kernel[(m,)](x, q.view(torch.uint8), scale, k, x.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK=block, num_warps=min(max(block // 512, 1), 16))
    return q, scale
