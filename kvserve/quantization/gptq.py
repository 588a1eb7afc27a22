"""GPTQ checkpoints (AutoGPTQ / GPTQModel "gptq" format, v1 and v2): 4 or 8 bit, any group
size (-1: one group per row), act-order (`g_idx`), symmetric or not.

qweight int32 [K * bits / 32, N] packs input rows; qzeros int32 [G, N * bits / 32] packs
output columns and, in the v1 format, stores zero - 1; scales fp16 [G, N]; g_idx [K].
w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.quantization.checkpoint import CheckpointGrid, GridFormat, unpack_int32

SUPPORTED_BITS = (4, 8)
SUPPORTED_FORMATS = ("gptq", "gptq_v2")


class GPTQFormat(GridFormat):
    quant_method = "gptq"
    packed_suffix = "qweight"

    def __init__(self, config: dict[str, Any], source: str) -> None:
        super().__init__(config, source)
        self.bits = config.get("bits")
        if self.bits not in SUPPORTED_BITS:
            raise self.unsupported("bits", self.bits, ", ".join(map(str, SUPPORTED_BITS)))
        self.checkpoint_format = config.get("checkpoint_format", "gptq")
        if self.checkpoint_format not in SUPPORTED_FORMATS:
            raise self.unsupported("checkpoint_format", self.checkpoint_format, ", ".join(SUPPORTED_FORMATS))
        if config.get("lm_head"):
            raise self.unsupported("lm_head", True, "false (the LM head stays in the run dtype)")
        if config.get("dynamic"):
            raise self.unsupported("dynamic", "per-module overrides", "one bit width for all layers")

    def unpack(self, tensors: dict[str, torch.Tensor], prefix: str) -> CheckpointGrid:
        qweight = self.tensor(tensors, f"{prefix}.qweight")
        scales = self.tensor(tensors, f"{prefix}.scales")
        qzeros = self.tensor(tensors, f"{prefix}.qzeros")
        q = unpack_int32(qweight, self.bits, dim=0).T.contiguous()  # [N, K]
        zero = unpack_int32(qzeros, self.bits, dim=1)
        if self.checkpoint_format == "gptq":
            zero = zero + 1  # v1 stores zero - 1 (an AutoGPTQ quirk kept for compatibility)
        if q.shape[0] != scales.shape[1] or zero.shape != scales.shape:
            raise ValueError(f"{self.source}: {prefix}: qweight {tuple(qweight.shape)}, qzeros "
                             f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} disagree for {self.bits} bits")
        return CheckpointGrid(q, scales.T.contiguous(), zero.T.contiguous(), self.bits, tensors.get(f"{prefix}.g_idx"))
