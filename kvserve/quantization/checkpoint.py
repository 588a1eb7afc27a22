"""Pre-quantized Hugging Face checkpoints (config.json `quantization_config`): each integer
format unpacks a layer's tensors into a `CheckpointGrid`, w = (q - zero) * scale per group,
which becomes an int4/int8 kernel layer exactly, or dense fp32 weights when its groups are
not contiguous (GPTQ act-order), also exactly. fp8 formats (fp8_checkpoint.py) build their
layer directly."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvserve.quantization.base import QuantizedLinear
from kvserve.quantization.grid import GroupGrid, grid_linear


@dataclass
class CheckpointGrid:
    q: torch.Tensor  # [N, K] int32, unsigned in [0, 2**bits)
    scale: torch.Tensor  # [N, G] in the checkpoint's dtype
    zero: torch.Tensor  # [N, G] integer zero points in the same unsigned domain as q
    bits: int
    g_idx: torch.Tensor | None = None  # [K] group of each input column; None: k // group size

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def contiguous_groups(self) -> bool:
        if self.g_idx is None:
            return True
        expected = torch.arange(self.q.shape[1]) // self.group_size
        return torch.equal(self.g_idx.long().cpu(), expected)

    def dequantize(self) -> torch.Tensor:
        """fp32 weights; (q - zero) * scale is exact in fp32 for fp16/bf16/fp32 scales."""
        g_idx = self.g_idx.long() if self.g_idx is not None else torch.arange(self.q.shape[1]) // self.group_size
        return (self.q - self.zero[:, g_idx]).float() * self.scale.float()[:, g_idx]

    def to_group_grid(self) -> GroupGrid:
        """q * scale + offset with offset = -zero * scale (both products exact, so is
        their sum); 8-bit q moves to int8 by -128, folded into the offset."""
        scale = self.scale.float()
        if self.bits == 4:
            return GroupGrid(self.q.to(torch.uint8), scale, -self.zero.float() * scale, self.group_size, bits=4)
        return GroupGrid((self.q - 128).to(torch.int8), scale, (128 - self.zero.float()) * scale, self.group_size)


class CheckpointFormat(ABC):
    """One `quant_method`: validates its config at load, unpacks a layer's tensors."""

    quant_method: ClassVar[str]
    packed_suffix: ClassVar[str]  # the tensor whose presence marks a quantized layer

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config, self.source = config, source

    def unsupported(self, key: str, value: Any, supported: str) -> ValueError:
        return ValueError(
            f"{self.source}: quantization_config quant_method={self.quant_method!r} has "
            f"{key}={value!r}, which is not supported; supported: {supported}"
        )

    @abstractmethod
    def linear(self, tensors: dict[str, torch.Tensor], shards: list[str], bias: torch.Tensor | None) -> QuantizedLinear | None:
        """The layer of the row shards `shards` (stacked in order), removing the tensors it
        consumes from `tensors`; or None after putting exact fp32 `{shard}.weight` tensors
        back for the float layer instead."""

    def consumed(self, tensors: dict[str, torch.Tensor], prefix: str) -> list[str]:
        """The tensor names of layer `prefix` that `unpack` replaces (its bias stays)."""
        return [name for name in tensors if name.startswith(prefix + ".") and name != prefix + ".bias"]

    def tensor(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{self.source}: {self.quant_method} checkpoint has no tensor {name!r}")
        return tensors[name]


class GridFormat(CheckpointFormat):
    """An integer format: each shard unpacks to a `CheckpointGrid`."""

    @abstractmethod
    def unpack(self, tensors: dict[str, torch.Tensor], prefix: str) -> CheckpointGrid:
        """The grid of layer `prefix` (e.g. model.layers.0.self_attn.q_proj); the error
        names the tensor if one is missing or misshapen."""

    def linear(self, tensors: dict[str, torch.Tensor], shards: list[str], bias: torch.Tensor | None) -> QuantizedLinear | None:
        # Act-order grids (groups not contiguous) go back as exact fp32 weights.
        grids = [self.unpack(tensors, hf) for hf in shards]
        for hf in shards:
            for name in self.consumed(tensors, hf):
                del tensors[name]
        if all(g.contiguous_groups() for g in grids):
            return grid_linear([g.to_group_grid() for g in grids], bias)
        tensors.update({f"{hf}.weight": g.dequantize() for hf, g in zip(shards, grids)})
        return None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Little-endian bit fields of int32 words along `dim`: element i of a word sits at
    bits [i * bits, (i + 1) * bits) (the GPTQ, AWQ and compressed-tensors convention for
    4 and 8 bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    fields = (moved[..., None] >> shifts) & ((1 << bits) - 1)
    return fields.reshape(*moved.shape[:-1], -1).movedim(-1, dim)
