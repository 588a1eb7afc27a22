"""A quantized weight unpacked to the activation dtype in one Triton pass: what the dense
path of many rows multiplies with cuBLAS."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _unpack_kernel(
    w_ptr, scale_ptr, offset_ptr, out_ptr, bytes_per_row, stride_wn, stride_sn, stride_on,
    GROUP_BYTES: tl.constexpr, BLOCK_GROUPS: tl.constexpr, FOUR_BIT: tl.constexpr, HAS_OFFSET: tl.constexpr,
):
    """BLOCK_GROUPS whole groups of one weight row as offset + q * scale in fp32, rounded
    once to the output dtype. FOUR_BIT: byte j of a row holds k = 2 j (low nibble) and
    2 j + 1 (high), unsigned; else one signed int8 a byte. Loads and stores are contiguous
    runs of the row; one scale (and offset) a group."""
    PER_BYTE: tl.constexpr = 2 if FOUR_BIT else 1
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    byte = groups[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :]
    w = tl.load(w_ptr + row * stride_wn + byte, mask=byte < bytes_per_row, other=0)
    group_mask = groups < tl.cdiv(bytes_per_row, GROUP_BYTES)
    scale = tl.load(scale_ptr + row * stride_sn + groups, mask=group_mask, other=0.0)[:, None]
    offset = 0.0
    if HAS_OFFSET:
        offset = tl.load(offset_ptr + row * stride_sn + groups, mask=group_mask, other=0.0)[:, None]
    if FOUR_BIT:
        low = offset + (w & 15).to(tl.float32) * scale
        high = offset + (w >> 4).to(tl.float32) * scale
        values = tl.join(low, high).reshape(BLOCK_GROUPS, 2 * GROUP_BYTES)  # k = 2 j, 2 j + 1 in order
    else:
        values = offset + w.to(tl.float32) * scale
    cols = groups[:, None] * (PER_BYTE * GROUP_BYTES) + tl.arange(0, PER_BYTE * GROUP_BYTES)[None, :]
    tl.store(out_ptr + row * stride_on + cols, values.to(out_ptr.dtype.element_ty),
             mask=cols < PER_BYTE * bytes_per_row)


def unpack_weight(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int,
                  dtype: torch.dtype, four_bit: bool) -> torch.Tensor | None:
    """The weight [N, K] in `dtype`, from nibble pairs qweight [N, K / 2] (uint8, four_bit)
    or int8 qweight [N, K], and fp32 scale (and offset) [N, K / group_size], in one pass
    (read the stored bytes, write the dtype's): what a dense matmul of many rows runs on.
    None unless a group's bytes are a power of two from 1 to 512 (one tile row)."""
    n, bytes_per_row = qweight.shape
    group_bytes = group_size // 2 if four_bit else group_size
    if ((four_bit and group_size % 2) or group_bytes < 1 or group_bytes & (group_bytes - 1) or group_bytes > 512
            or qweight.stride(-1) != 1):
        return None
    out = torch.empty((n, bytes_per_row * (2 if four_bit else 1)), dtype=dtype, device=qweight.device)
    block_groups = max(1, 512 // group_bytes)  # 512 bytes of a row per program
    _unpack_kernel[(n, triton.cdiv(triton.cdiv(bytes_per_row, group_bytes), block_groups))](
        qweight, scale, offset if offset is not None else scale, out, bytes_per_row, qweight.stride(0),
        scale.stride(0), out.stride(0),
        GROUP_BYTES=group_bytes, BLOCK_GROUPS=block_groups, FOUR_BIT=four_bit, HAS_OFFSET=offset is not None,
    )
    return out
