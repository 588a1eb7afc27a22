"""compressed-tensors checkpoints in the "pack-quantized" format that llmcompressor writes
for W4A16 / W8A16 (int weights, 16-bit activations): per-channel or group strategy,
symmetric or not, optional `weight_g_idx` (activation ordering). The "float-quantized"
format (fp8 weights) is read by fp8_checkpoint.py.

weight_packed int32 [N, K * bits / 32] packs each row's values offset to unsigned
(q + 2**(bits - 1)); weight_scale [N, G]; weight_zero_point (asymmetric only) int32
[N * bits / 32, G] packs along N the same way. w = (q - zero_point) * scale.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.quantization.checkpoint import CheckpointFormat, CheckpointGrid, GridFormat, unpack_int32
from kvserve.quantization.fp8_checkpoint import CompressedTensorsFp8Format

SUPPORTED_BITS = (4, 8)
SUPPORTED_STRATEGIES = ("channel", "group")


class CompressedTensorsFormat(GridFormat):
    quant_method = "compressed-tensors"
    packed_suffix = "weight_packed"

    def __init__(self, config: dict[str, Any], source: str) -> None:
        super().__init__(config, source)
        groups = config.get("config_groups") or {}
        if not groups:
            raise self.unsupported("config_groups", groups, "at least one W4A16 / W8A16 group")
        for name, group in groups.items():
            fmt = group.get("format") or config.get("format")
            if fmt != "pack-quantized":
                raise self.unsupported(f"config_groups.{name}.format", fmt, "pack-quantized, float-quantized (fp8)")
            if group.get("input_activations") is not None:
                raise self.unsupported(f"config_groups.{name}.input_activations",
                                       group["input_activations"], "none (weight-only W4A16 / W8A16)")
            weights = group.get("weights") or {}
            if weights.get("type") != "int" or weights.get("num_bits") not in SUPPORTED_BITS:
                raise self.unsupported(f"config_groups.{name}.weights",
                                       f"{weights.get('type')} {weights.get('num_bits')}-bit", "int 4-bit, int 8-bit")
            if weights.get("strategy") not in SUPPORTED_STRATEGIES:
                raise self.unsupported(f"config_groups.{name}.weights.strategy", weights.get("strategy"),
                                       ", ".join(SUPPORTED_STRATEGIES))

    def unpack(self, tensors: dict[str, torch.Tensor], prefix: str) -> CheckpointGrid:
        packed = self.tensor(tensors, f"{prefix}.weight_packed")
        scale = self.tensor(tensors, f"{prefix}.weight_scale")
        n, k = (int(v) for v in self.tensor(tensors, f"{prefix}.weight_shape"))
        bits = packed.shape[1] * 32 // k if k else 0  # the group's num_bits, read from the shapes
        if bits not in SUPPORTED_BITS or packed.shape[1] * 32 != bits * k or scale.shape[0] != n:
            raise ValueError(f"{self.source}: {prefix}: weight_packed {tuple(packed.shape)} and weight_scale "
                             f"{tuple(scale.shape)} do not fit weight_shape {(n, k)} at 4 or 8 bits")
        q = unpack_int32(packed, bits, dim=1)[:, :k]
        if f"{prefix}.weight_zero_point" in tensors:
            zero = unpack_int32(tensors[f"{prefix}.weight_zero_point"], bits, dim=0)[:n]
        else:  # symmetric: signed zero point 0 is 2**(bits - 1) unsigned
            zero = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int32)
        return CheckpointGrid(q, scale, zero, bits, tensors.get(f"{prefix}.weight_g_idx"))


def compressed_tensors_format(config: dict[str, Any], source: str) -> CheckpointFormat:
    """float-quantized (fp8 weights) when every group is, else the integer format (which
    names what it does not support)."""
    groups = (config.get("config_groups") or {}).values()
    if groups and all((g.get("format") or config.get("format")) == "float-quantized" for g in groups):
        return CompressedTensorsFp8Format(config, source)
    return CompressedTensorsFormat(config, source)
