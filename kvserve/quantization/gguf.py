"""gguf: llama.cpp's quantized blocks kept packed, repacked at load into our kernel layouts.

Every supported block type is an affine grid per group, w = q * scale + offset, so each
unpacks exactly (all products below fit fp32's 24-bit significand) into:

* 4-bit types -> `Int4Linear` with 32-wide groups and float zero points, the layout of
  torch's CPU int4 kernel (w = (q - 8) * s + z with z = offset + 8 * s):
  Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m), Q4_K (super-blocks of 256 with 6-bit
  sub-block scales and mins: w = d * sc * q - dmin * m).
* 5-bit types -> `Int5Linear` (the int4 nibbles plus a plane of high bits, read by
  kvserve's CPU kernel; int8 where that kernel does not run): Q5_0 (w = d * q - 16 * d),
  Q5_1 (w = d * q + m), Q5_K (groups of 32, w = d * sc * q - dmin * m). llama.cpp's K-quant
  mixes fall back to Q5_0/Q5_1/Q8_0 for rows that are no multiple of 256 (SmolLM2's 576).
* 8-bit and wider grids -> `GroupInt8Linear` (int8 q with fp32 group scales and offsets):
  Q8_0 (groups of 32, w = d * q), Q6_K (groups of 16, w = d * sc * (q - 32)).

`grid.grid_linear` picks the layer; fused layers whose shards differ in type (Q4_K q/k
with a Q6_K v) share one int8 layer. The fp32 dequantized model (quantization=None)
stays the exact reference path.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from kvserve.quantization.base import QuantizationMethod, QuantizedLinear
from kvserve.quantization.grid import GroupGrid

FOUR_BIT_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
FIVE_BIT_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K)
INT8_TYPES = (T.Q8_0, T.Q6_K)
SUPPORTED_TYPES = FOUR_BIT_TYPES + FIVE_BIT_TYPES + INT8_TYPES
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
_QK_K = 256
_BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
_BLOCK_SIZE = {T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.Q4_K: _QK_K, T.Q5_K: _QK_K,
               T.Q6_K: _QK_K}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dimension (2 bytes) of a uint8 tensor, as fp32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 32*c bytes] -> [..., 2c, 32]: each 32-byte run gives 32 low nibbles then 32
    high nibbles (Q4_0/Q4_1 have one 16-byte run: 16 low then 16 high)."""
    run = 32 if qs.shape[-1] >= 32 else qs.shape[-1]
    runs = qs.reshape(*qs.shape[:-1], -1, 1, run)
    return torch.cat([runs & 15, runs >> 4], dim=-2).reshape(*qs.shape[:-1], -1, run)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte K-quant field -> 8 six-bit scales and 8 six-bit mins (ggml's
    get_scale_min_k4)."""
    d, m, md = scales.reshape(*scales.shape[:-1], 3, 4).unbind(-2)
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def unpack_blocks(raw: np.ndarray, qtype: T, shape: tuple[int, int], name: str) -> GroupGrid:
    """Raw GGUF blocks of a [N, K] tensor (numpy uint8 [N, K / block * bytes]) -> grid."""
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {name!r} has type {qtype.name}; quantization='gguf' keeps packed "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)} (load with quantization=None to "
            "dequantize other types)"
        )
    n, k = shape
    if k % _BLOCK_SIZE[qtype]:
        raise ValueError(f"GGUF tensor {name!r}: row length {k} is not a multiple of the "
                         f"{qtype.name} block size {_BLOCK_SIZE[qtype]}")
    blocks = torch.from_numpy(np.array(raw, copy=True)).reshape(n, k // _BLOCK_SIZE[qtype], _BLOCK_BYTES[qtype])
    if qtype == T.Q8_0:
        d = _f16(blocks[..., 0:2])
        q = blocks[..., 2:].contiguous().view(torch.int8)
        return GroupGrid(q.reshape(n, k), d, None, 32)
    if qtype in (T.Q4_0, T.Q4_1):
        d = _f16(blocks[..., 0:2])
        offset = -8 * d if qtype == T.Q4_0 else _f16(blocks[..., 2:4])
        q = _nibbles(blocks[..., 2 if qtype == T.Q4_0 else 4:])
        return GroupGrid(q.reshape(n, k), d, offset, 32, bits=4)
    if qtype in (T.Q5_0, T.Q5_1):  # d, [m], 32 high bits (bit i: element i's), 16 bytes of nibbles
        d = _f16(blocks[..., 0:2])
        start = 2 if qtype == T.Q5_0 else 4
        high = blocks[..., start:start + 4].reshape(n, -1, 4, 1) >> torch.arange(8, dtype=torch.uint8)
        q = _nibbles(blocks[..., start + 4:]).reshape(n, -1, 32) | ((high.reshape(n, -1, 32) & 1) << 4)
        offset = -16 * d if qtype == T.Q5_0 else _f16(blocks[..., 2:4])
        return GroupGrid(q.reshape(n, k), d, offset, 32, bits=5)
    if qtype == T.Q6_K:
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
        d = _f16(blocks[..., 208:210])
        # Per 128-element half: ql[0:32] low nibbles -> 0..31, ql[32:64] low -> 32..63,
        # ql[0:32] high -> 64..95, ql[32:64] high -> 96..127; bits 2i, 2i+1 of qh[l] are
        # the top two bits of run i. _nibbles gives (run, nibble) order: swap to (nibble, run).
        low = _nibbles(ql).reshape(n, -1, 2, 2, 2, 32).permute(0, 1, 2, 4, 3, 5).reshape(n, -1, 2, 4, 32)
        high = qh.reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
        q = (low | ((high & 3) << 4)).to(torch.int8) - 32
        return GroupGrid(q.reshape(n, k), (d[..., None] * sc).reshape(n, -1), None, 16)
    # Q4_K / Q5_K: d, dmin, 12 bytes of scales/mins, [Q5_K: 32 bytes of high bits], qs.
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _k_scales_mins(blocks[..., 4:16])
    q = _nibbles(blocks[..., 48:] if qtype == T.Q5_K else blocks[..., 16:])  # [.., 8, 32]
    if qtype == T.Q5_K:
        bits = blocks[..., 16:48].reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)
        q = q | ((bits & 1) << 4)
    scale = (d[..., None] * sc).reshape(n, -1)
    offset = -(dmin[..., None] * mn).reshape(n, -1)
    return GroupGrid(q.reshape(n, k), scale, offset, 32, bits=4 if qtype == T.Q4_K else 5)


class GGUFMethod(QuantizationMethod):
    """Selected by name; the GGUF loader builds the layers from the file's blocks."""

    name = "gguf"

    def quantize_linear(self, name: str, layer: nn.Linear) -> QuantizedLinear:
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's blocks packed; layer {name!r} comes from "
            "a float checkpoint (use int8, int4 or nf4 to quantize it)"
        )
