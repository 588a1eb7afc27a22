"""int5: 5-bit group-wise weights with float zero points, w = q * scale + minimum, q in [0, 31]:
the grids of GGUF's Q5_0 (minimum -16 * d), Q5_1 and Q5_K, which llama.cpp's K-quant mixes use
for whole files (Q5_K_M) and for rows that are no multiple of 256 (SmolLM2's 576 columns).

The weight is the int4 layout's nibble pairs (the low four bits) plus a plane of high bits,
read together by kvserve's int4 CPU kernel: 6 bits a weight with fp16 scales and minimums
(Q5_0, Q5_1), 7 with fp32 ones (Q5_K), against 9-10 for the same grid held as int8
(GroupInt8Linear).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.ops.cpu import int4_matmul_op
from kvserve.quantization.base import QuantizedLinear
from kvserve.quantization.int4 import _pack_nibbles, _unpack_nibbles, dequantize_int4, exact_in_fp16

# The kernel's plane, per row 16 bytes for each HIGH_BLOCK columns (padded with zeros), in the
# order the kernel reads it (decode_matmul.cpp, kHighBlockBytes): for each whole block four
# little-endian uint32 masks, bit L of mask i the high bit of the block's column 4L + i; for
# each 32-column chunk after the last whole block a uint16 mask of its even columns (bit b:
# column 2b) and one of its odd columns.
HIGH_BLOCK = 128
_BIT_WEIGHTS = 1 << torch.arange(8, dtype=torch.int32)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., 8m] values in {0, 1} -> [..., m] bytes, bit t of byte j the value at 8j + t."""
    return torch.from_numpy(np.packbits(bits.contiguous().numpy(), axis=-1, bitorder="little"))


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    return ((packed.to(torch.int32)[..., None] & _BIT_WEIGHTS) != 0).flatten(-2).to(torch.uint8)


def _plane_parts(k: int) -> tuple[int, int, int]:
    """Columns in whole blocks, 32-column chunks after them, and the plane's bytes a row."""
    if k % 32:
        raise ValueError(f"a 5-bit row's length must be a multiple of 32, got {k}")
    whole = k // HIGH_BLOCK * HIGH_BLOCK
    return whole, (k - whole) // 32, -(-k // HIGH_BLOCK) * 16


def pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in [0, 31] (K a multiple of 32) -> the kernel's plane of their high bits,
    uint8 [N, ceil(K / 128) * 16]."""
    n, k = q.shape
    whole, chunks, row_bytes = _plane_parts(k)
    bits = q >> 4
    plane = torch.zeros(n, row_bytes, dtype=torch.uint8)
    blocks = bits[:, :whole].reshape(n, whole // HIGH_BLOCK, HIGH_BLOCK // 4, 4).transpose(2, 3)  # [N, block, i, L]
    plane[:, : whole // 8] = _pack_bits(blocks).reshape(n, -1)
    if chunks:
        by_parity = bits[:, whole:].reshape(n, chunks, 16, 2).transpose(2, 3)  # [N, chunk, parity, b]
        plane[:, whole // 8 : whole // 8 + 4 * chunks] = _pack_bits(by_parity).reshape(n, -1)
    return plane


def unpack_high_bits(plane: torch.Tensor, k: int) -> torch.Tensor:
    """pack_high_bits' plane -> the high bits, uint8 [N, K] in {0, 1}."""
    n = plane.shape[0]
    whole, chunks, _ = _plane_parts(k)
    blocks = _unpack_bits(plane[:, : whole // 8].reshape(n, whole // HIGH_BLOCK, 4, 4))  # [N, block, i, L]
    blocks = blocks.transpose(2, 3)
    tail = _unpack_bits(plane[:, whole // 8 : whole // 8 + 4 * chunks].reshape(n, chunks, 2, 2)).transpose(2, 3)
    return torch.cat([blocks.reshape(n, whole), tail.reshape(n, k - whole)], dim=1)


def int5_kernel_applies(group_size: int, device: torch.device) -> bool:
    """Whether an Int5Linear of this group size runs kvserve's CPU kernel on `device`."""
    return device.type == "cpu" and group_size % 32 == 0 and group_size <= 4096 and int4_matmul_op() is not None


class Int5Linear(QuantizedLinear):
    """5-bit q as nibble pairs [N, K / 2] and a high-bit plane, with fp32 scales and minimums
    per group (fp16 where that holds them exactly: Q5_0's and Q5_1's d and m). Decode rows run
    kvserve's CPU kernel (int5_kernel_applies); anything else dequantizes per call (or takes the
    dense copy the CPU plans keep)."""

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int,
        bias: torch.Tensor | None,
    ) -> None:
        """q uint8 [N, K] in [0, 31], scale and minimum [N, K / group_size]."""
        n, k = q.shape
        if k % group_size or k % 2:
            raise ValueError(f"Int5Linear needs an even row length divisible by the group size {group_size}, got {k}")
        if q.numel() and int(q.max()) > 31:
            raise ValueError("Int5Linear needs q in [0, 31]")
        super().__init__(k, n, bias)
        self.group_size = group_size
        self.register_buffer("qweight", _pack_nibbles(q & 15).reshape(n, k // 2))
        self.register_buffer("high_bits", pack_high_bits(q))
        compact = exact_in_fp16(scale.float()) and exact_in_fp16(minimum.float())
        dtype = torch.float16 if compact else torch.float32
        self.register_buffer("scale", scale.to(dtype).contiguous())
        self.register_buffer("minimum", minimum.to(dtype).contiguous())
        self.own_kernel = int4_matmul_op() if int5_kernel_applies(group_size, q.device) else None

    def _apply(self, fn, recurse: bool = True):  # every .to() / .cuda() of the module
        super()._apply(fn, recurse)
        if self.qweight.device.type != "cpu":
            self.own_kernel = None
        return self

    def unpacked(self) -> torch.Tensor:
        low = _unpack_nibbles(self.qweight.flatten(), self.out_features, self.in_features)
        return low | (unpack_high_bits(self.high_bits.cpu(), self.in_features).to(low.device) << 4)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.unpacked(), self.scale, self.minimum).to(dtype)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.own_kernel is None:
            return None
        y = self.own_kernel(x.reshape(-1, self.in_features).float(), self.qweight, self.scale, self.minimum,
                            self.group_size, self.high_bits)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}, bits=5"
