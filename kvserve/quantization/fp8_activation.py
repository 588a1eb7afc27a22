"""Dynamic per-token fp8 quantization of activations for torch._scaled_mm, one Triton
kernel per call: the torch form (abs, amax, divide, clamp, cast) is about seven kernels,
which at prefill sizes cost as much as the fp8 matmul they feed. Where the activation comes
from RMSNorm or SiLU-and-mul, their kernels quantize it instead (store_fp8_row) and attach
the result to their output (attach_fp8_rows), saving this kernel's launch and read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@triton.jit
def store_fp8_row(values, cols, mask, q_ptr, scale_ptr, row, num_cols, FP8_MAX: tl.constexpr):
    """One whole row of activations (fp32 holding the activation dtype's values, masked lanes
    0) quantized per token: its e4m3 values at q_ptr + row * num_cols (a uint8 view) and its
    scale at scale_ptr + row. The producers of an fp8 linear's input (RMSNorm, SiLU-and-mul)
    call this on their own output, so the values equal quantize_per_token's of that output."""
    # Correctly rounded divisions (Triton's `/` is approximate): the same bits as torch's.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(values), axis=0), 1e-12), FP8_MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(values, scale), -FP8_MAX), FP8_MAX)
    # Stored through uint8 bits (the pointer is a uint8 view of the fp8 output).
    tl.store(q_ptr + row * num_cols + cols, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_fp8_row(x, cols, mask, q_ptr, scale_ptr, row, num_cols, FP8_MAX)


def empty_fp8_rows(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of a per-token quantization: x_fp8 [m, k] float8_e4m3fn, scale fp32 [m, 1]."""
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def attach_fp8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Hand x's per-token fp8 form (q, scale) to the fp8 linear that consumes x, as an
    attribute of x itself: it lives as long as x, and a view or copy of x does not carry it."""
    x.fp8_rows = (q, scale)
    return x


def attached_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    return getattr(x, "fp8_rows", None)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (x_fp8 [M, K] float8_e4m3fn, scale fp32 [M, 1])
    with x ~= x_fp8 * scale; each row's absolute maximum maps to the largest e4m3 value."""
    m, k = x.shape
    assert x.stride(-1) == 1
    q, scale = empty_fp8_rows(m, k, x.device)
    if m:
        block = triton.next_power_of_2(k)
        _per_token_fp8_kernel[(m,)](x, q.view(torch.uint8), scale, k, x.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK=block, num_warps=min(max(block // 512, 1), 16))
    return q, scale
