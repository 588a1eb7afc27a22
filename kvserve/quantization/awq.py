"""AWQ checkpoints (AutoAWQ "gemm" packing, 4 bit, with zero points).

qweight int32 [K, N / 8] and qzeros int32 [G, N / 8] pack 8 output columns per word in
the interleaved order [0, 2, 4, 6, 1, 3, 5, 7]; scales fp16 [G, N]; groups contiguous.
w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = k // group_size.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.quantization.checkpoint import CheckpointGrid, GridFormat, unpack_int32

# Nibble i of a packed word holds column _PACK_ORDER[i] of its 8.
_PACK_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    nibbles = unpack_int32(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)
    return nibbles[..., torch.argsort(_PACK_ORDER)].reshape(packed.shape[0], -1)


class AWQFormat(GridFormat):
    quant_method = "awq"
    packed_suffix = "qweight"

    def __init__(self, config: dict[str, Any], source: str) -> None:
        super().__init__(config, source)
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise self.unsupported("bits", bits, "4")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise self.unsupported("version", version, "gemm")
        if not config.get("zero_point", True):
            raise self.unsupported("zero_point", False, "true")

    def unpack(self, tensors: dict[str, torch.Tensor], prefix: str) -> CheckpointGrid:
        q = _unpack_columns(self.tensor(tensors, f"{prefix}.qweight"))  # [K, N]
        zero = _unpack_columns(self.tensor(tensors, f"{prefix}.qzeros"))  # [G, N]
        scales = self.tensor(tensors, f"{prefix}.scales")
        if zero.shape != scales.shape or q.shape[1] != scales.shape[1] or q.shape[0] % scales.shape[0]:
            raise ValueError(f"{self.source}: {prefix}: qweight, qzeros and scales shapes disagree "
                             f"({tuple(q.shape)}, {tuple(zero.shape)}, {tuple(scales.shape)} unpacked)")
        return CheckpointGrid(q.T.contiguous(), scales.T.contiguous(), zero.T.contiguous(), 4)
