"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) written from float weights, which gguf-py
reads but cannot write: to build the K-quant mixes people download (Q4_K_M, ...) from the
embedded model and measure how kvserve runs them.

Each super-block of 256 weights has sub-block scales (and, for Q4_K/Q5_K, minimums) stored
as 6-bit (8-bit for Q6_K) multiples of one fp16 scale each. The scales here come from each
sub-block's range by plain rounding, not llama.cpp's iterative search (make_qkx2_quants), so
the error is somewhat larger than llama.cpp's for the same type; the block layouts are
ggml's (block_q4_K, block_q5_K, block_q6_K), checked against gguf-py's dequantizer.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

SUPER_BLOCK = 256
K_QUANT_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[...] fp32 -> [..., 2] the little-endian bytes of their fp16 values."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape, 2)


def _as_fp16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).float()


def _sub_block_steps(steps: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per super-block, an fp16 base and the sub-block multiples of it (0 .. 2^bits - 1) that
    approximate `steps` [n, blocks, sub] (>= 0)."""
    top = 2**bits - 1
    base = _as_fp16(steps.amax(dim=-1) / top)
    multiples = torch.where(base[..., None] > 0, torch.round(steps / base.clamp_min(1e-30)[..., None]), 0)
    return base, multiples.clamp(0, top)


def _quantize_affine(weight: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K: w ~ d * sc * q - dmin * m per 32-wide sub-block, q in [0, levels]."""
    n, k = weight.shape
    groups = weight.reshape(n, k // SUPER_BLOCK, 8, 32)
    low = groups.amin(dim=-1).clamp(max=0)
    high = groups.amax(dim=-1).clamp(min=0)
    d, sc = _sub_block_steps((high - low) / levels, 6)
    dmin, mins = _sub_block_steps(-low, 6)
    step, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * mins)[..., None]
    q = torch.where(step > 0, torch.round((groups + offset) / step.clamp_min(1e-30)), 0).clamp(0, levels)
    return d, dmin, sc.to(torch.uint8), mins.to(torch.uint8), q.to(torch.uint8)


def _pack_scales_mins(sc: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and 8 six-bit mins -> ggml's 12-byte field (get_scale_min_k4's inverse):
    bytes 0-3 scales 0-3 with scales 4-7's top bits, 4-7 the mins alike, 8-11 their low bits."""
    return torch.cat([
        (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
        (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4),
    ], dim=-1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 2c, 32] values < 16 -> [..., 32c] bytes: each 32-byte run holds one 32-value
    sub-block in its low nibbles and the next in its high ones."""
    runs = q.reshape(*q.shape[:-2], -1, 2, 32)
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*q.shape[:-2], -1)


def _quantize_q6_k(weight: torch.Tensor) -> torch.Tensor:
    """w ~ d * sc * (q - 32) per 16-wide sub-block, sc int8 (>= 0 here), q in [0, 63]."""
    n, k = weight.shape
    groups = weight.reshape(n, k // SUPER_BLOCK, 16, 16)
    d, sc = _sub_block_steps(groups.abs().amax(dim=-1) / 31, 7)
    step = (d[..., None] * sc)[..., None]
    q = (torch.where(step > 0, torch.round(groups / step.clamp_min(1e-30)), 0).clamp(-32, 31) + 32).to(torch.uint8)
    # Per 128-value half: value 32 p + l (p = 2 * nibble + run) is ql[64 half + 32 run + l]'s
    # low (nibble 0) or high nibble, and bits 2p, 2p + 1 of qh[32 half + l] its top two bits.
    halves = q.reshape(n, -1, 2, 2, 2, 32)  # [.., half, nibble, run, lane]
    ql = (halves[..., 0, :, :] & 15) | ((halves[..., 1, :, :] & 15) << 4)  # [.., half, run, lane]
    top = (q.reshape(n, -1, 2, 4, 32) >> 4).to(torch.int32)
    qh = (top << (2 * torch.arange(4, dtype=torch.int32))[:, None]).sum(dim=-2).to(torch.uint8)  # [.., half, lane]
    return torch.cat([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.to(torch.int8).view(torch.uint8),
                      _fp16_bytes(d)], dim=-1)


def quantize_k(weight: np.ndarray | torch.Tensor, qtype: T) -> np.ndarray:
    """Float [n, k] (k a multiple of 256) -> the raw blocks of `qtype`, uint8 [n, k / 256 * bytes]
    as gguf's writer takes them."""
    weight = torch.as_tensor(weight, dtype=torch.float32)
    n, k = weight.shape
    if qtype not in K_QUANT_TYPES or k % SUPER_BLOCK:
        raise ValueError(f"quantize_k writes {', '.join(t.name for t in K_QUANT_TYPES)} rows of a multiple "
                         f"of {SUPER_BLOCK}; got {qtype.name} with {k} columns")
    if qtype == T.Q6_K:
        blocks = _quantize_q6_k(weight)
    else:
        d, dmin, sc, mins, q = _quantize_affine(weight, 15 if qtype == T.Q4_K else 31)
        parts = [_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales_mins(sc, mins)]
        if qtype == T.Q5_K:  # bit i of qh[l]: the top bit of sub-block i's value l
            top = (q >> 4).to(torch.int32)
            parts.append((top << torch.arange(8, dtype=torch.int32)[:, None]).sum(dim=-2).to(torch.uint8))
        parts.append(_pack_nibbles(q & 15))
        blocks = torch.cat(parts, dim=-1)
    return blocks.reshape(n, -1).numpy()
