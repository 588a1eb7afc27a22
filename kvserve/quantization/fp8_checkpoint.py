"""fp8 checkpoints: float8_e4m3fn `weight` tensors with fp32 (or 16-bit) scales, loaded
into `Fp8Linear` as stored (no requantization).

* compressed-tensors "float-quantized" (llmcompressor's FP8_DYNAMIC / FP8 schemes):
  `weight_scale` per output channel [N, 1], per tensor [1] / [], or per block
  [N / bn, K / bk]; w = weight * scale.
* Hugging Face quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3 style):
  `weight_scale_inv` per [bn, bk] block (weight_block_size, usually [128, 128]);
  w = weight * scale_inv.

Activations are quantized per token at run time whatever the checkpoint says: a static
`input_scale` is not used (per-token scales are at least as precise).
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.quantization.base import QuantizedLinear
from kvserve.quantization.checkpoint import CheckpointFormat
from kvserve.quantization.fp8 import FP8_DTYPE, Fp8Linear

WEIGHT_STRATEGIES = ("channel", "tensor", "block")


def row_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """A stored scale ([1, 1] per tensor, [N, 1] per channel, or [N / bn, K / bk] blocks,
    rounded up) as fp32 [N, G] rows of groups along K; blocks repeat over their bn rows and,
    where K is not a whole number of blocks, over each of their bk columns."""
    n, k = shape
    scale = scale.float()
    if block is None:
        return scale.expand(n, 1).contiguous()
    block_n, block_k = block
    rows = scale.repeat_interleave(block_n, dim=0)[:n]
    if k % block_k:
        rows = rows.repeat_interleave(block_k, dim=1)[:, :k]
    return rows.contiguous()


class Fp8CheckpointFormat(CheckpointFormat):
    """Shared by both fp8 formats: `scale_suffix` names the scale tensor, `block` its
    [bn, bk] block or None (per tensor or per channel)."""

    block: tuple[int, int] | None = None

    def linear(self, tensors: dict[str, torch.Tensor], shards: list[str], bias: torch.Tensor | None) -> QuantizedLinear:
        weights, scales = [], []
        for hf in shards:
            weight = self.tensor(tensors, f"{hf}.weight")
            scale = self.tensor(tensors, f"{hf}.{self.packed_suffix}")
            if weight.dtype != FP8_DTYPE or weight.dim() != 2:
                raise ValueError(f"{self.source}: {hf}.weight is {weight.dtype} {tuple(weight.shape)}, "
                                 f"expected 2-d {FP8_DTYPE}")
            n, k = weight.shape
            if self.block is not None:
                expected = (-(-n // self.block[0]), -(-k // self.block[1]))
            else:
                expected = (1, 1) if scale.numel() == 1 else (n, 1)
            if scale.numel() != expected[0] * expected[1]:
                raise ValueError(f"{self.source}: {hf}.{self.packed_suffix} {tuple(scale.shape)} does not fit "
                                 f"weight {(n, k)} ({f'blocks {self.block}' if self.block else 'per channel'})")
            weights.append(weight)
            scales.append(row_scales(scale.reshape(expected), (n, k), self.block))
            for name in self.consumed(tensors, hf):
                del tensors[name]
        return Fp8Linear(torch.cat(weights), torch.cat(scales), bias)


class CompressedTensorsFp8Format(Fp8CheckpointFormat):
    quant_method = "compressed-tensors"
    packed_suffix = "weight_scale"

    def __init__(self, config: dict[str, Any], source: str) -> None:
        super().__init__(config, source)
        blocks = set()
        for name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise self.unsupported(f"config_groups.{name}.weights",
                                       f"{weights.get('type')} {weights.get('num_bits')}-bit", "float 8-bit")
            strategy = weights.get("strategy")
            if strategy not in WEIGHT_STRATEGIES:
                raise self.unsupported(f"config_groups.{name}.weights.strategy", strategy, ", ".join(WEIGHT_STRATEGIES))
            if not weights.get("symmetric", True):
                raise self.unsupported(f"config_groups.{name}.weights.symmetric", False, "true")
            blocks.add(tuple(weights["block_structure"]) if strategy == "block" else None)
        if len(blocks) > 1:
            raise self.unsupported("config_groups", "groups with different weight blocks", "one block structure")
        self.block = blocks.pop() if blocks else None


class HFFp8Format(Fp8CheckpointFormat):
    quant_method = "fp8"
    packed_suffix = "weight_scale_inv"

    def __init__(self, config: dict[str, Any], source: str) -> None:
        super().__init__(config, source)
        block = config.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise self.unsupported("weight_block_size", block, "[block_n, block_k] (e.g. [128, 128])")
        if config.get("fmt", "e4m3") != "e4m3":
            raise self.unsupported("fmt", config.get("fmt"), "e4m3")
        self.block = (block[0], block[1])
