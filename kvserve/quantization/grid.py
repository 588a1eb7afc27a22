"""Exact group-wise affine grids, the common form of every pre-quantized format we load
(GGUF blocks, GPTQ, AWQ, compressed-tensors), and the layer each one becomes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.quantization.base import QuantizedLinear
from kvserve.quantization.int4 import Int4Linear
from kvserve.quantization.int5 import Int5Linear, int5_kernel_applies
from kvserve.quantization.int8 import GroupInt8Linear, dequantize_groups


class GroupGrid:
    """w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k // group_size (offset None
    means 0). `bits` 4 or 5: q is uint8 in [0, 15] or [0, 31] (the int4 kernel's ranges, without
    and with its high-bit plane); 8: q is int8. Every format's products fit fp32 exactly, so
    this is lossless."""

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int, bits: int = 8,
    ) -> None:
        if bits not in (4, 5, 8):
            raise ValueError(f"a grid's q has 4, 5 or 8 bits, not {bits}")
        self.q, self.scale, self.offset = q, scale.float(), None if offset is None else offset.float()
        self.group_size, self.bits = group_size, bits

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupGrid:
        """Apply a row permutation (llama's Q/K RoPE reordering) to every part."""
        offset = None if self.offset is None else fn(self.offset)
        return GroupGrid(fn(self.q), fn(self.scale), offset, self.group_size, self.bits)

    def dequantize(self) -> torch.Tensor:
        return dequantize_groups(self.q, self.scale, self.offset, self.group_size)

    def as_int8(self, group_size: int) -> GroupGrid:
        """The same weights as int8 q with `group_size`-wide groups (a divisor of ours);
        4- and 5-bit q fit int8 as they are."""
        repeat = self.group_size // group_size
        offset = None if self.offset is None else self.offset.repeat_interleave(repeat, dim=1)
        return GroupGrid(self.q.to(torch.int8), self.scale.repeat_interleave(repeat, dim=1), offset, group_size)


def grid_linear(shards: list[GroupGrid], bias: torch.Tensor | None,
                device: torch.device | str = "cpu") -> QuantizedLinear:
    """One layer, to run on `device`, from the grids of its row shards (q, k, v or gate, up)
    stacked in order: with one group size, the int4 kernel layout when every shard is 4-bit,
    the int5 one when every shard is 4- or 5-bit and a kernel reads it there (kvserve's CPU
    kernel); else group-wise int8 at the narrowest group size (wider groups split exactly)."""
    bits = max(g.bits for g in shards)
    group_size = min(g.group_size for g in shards)
    if bits <= 5 and all(g.group_size == group_size for g in shards):
        offsets = [g.offset if g.offset is not None else torch.zeros_like(g.scale) for g in shards]
        parts = (torch.cat([g.q for g in shards]), torch.cat([g.scale for g in shards]), torch.cat(offsets))
        if bits == 4:
            return Int4Linear(*parts, group_size, bias)
        if int5_kernel_applies(group_size, torch.device(device)):
            return Int5Linear(*parts, group_size, bias)
    if any(g.group_size % group_size for g in shards):
        raise ValueError(f"cannot stack shards with group sizes {[g.group_size for g in shards]}")
    grids = [g.as_int8(group_size) for g in shards]
    offset = None
    if any(g.offset is not None for g in grids):
        offset = torch.cat([g.offset if g.offset is not None else torch.zeros_like(g.scale) for g in grids])
    return GroupInt8Linear(
        torch.cat([g.q for g in grids]), torch.cat([g.scale for g in grids]), offset, group_size, bias
    )
