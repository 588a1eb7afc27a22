"""nf4: 4-bit NormalFloat with per-block absmax, as bitsandbytes defines it (blocks of 64
consecutive elements of the flattened weight, fp32 absmax, no double quantization; the
first element of a pair in the high nibble).

kvserve has no NF4 kernel, on CPU or GPU, so every call dequantizes the whole weight
(through fp32, several times the bytes of the unquantized weight): nf4 saves memory (about
0.56 byte per weight) but decodes slower than the unquantized model. It is here as
bitsandbytes' format and a quality reference (BENCHMARKS.md, "Quality"); int4 serves faster.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.quantization.base import QuantizationMethod, QuantizedLinear

# bitsandbytes' NF4 code book (functional.get_4bit_type("nf4")), quantiles of N(0, 1)
# scaled to [-1, 1] with an exact zero.
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020635843277, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])
# Byte -> (value of its high nibble, value of its low nibble): one gather per two weights.
_NF4_PAIRS = torch.stack([NF4_CODE.repeat_interleave(16), NF4_CODE.repeat(16)], dim=-1)
DEFAULT_BLOCK_SIZE = 64

logger = logging.getLogger(__name__)


def quantize_nf4(weight: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [ceil(numel / 2)], absmax fp32 [ceil(numel / block_size)])."""
    flat = weight.float().flatten()
    pad = -flat.numel() % block_size
    blocks = F.pad(flat, (0, pad)).reshape(-1, block_size)
    absmax = blocks.abs().amax(dim=-1)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    # Nearest code value; a value exactly between two goes to the lower, as in bitsandbytes.
    midpoints = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
    q = torch.bucketize(normalized, midpoints.to(normalized.device)).to(torch.uint8)
    q = q.flatten()[: flat.numel()]
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return (q[0::2] << 4) | q[1::2], absmax


def dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], block_size: int
) -> torch.Tensor:
    numel = shape[0] * shape[1]
    values = F.embedding(packed.to(torch.int32), _NF4_PAIRS.to(packed.device)).flatten()[:numel]
    blocks = F.pad(values, (0, absmax.numel() * block_size - numel)).reshape(-1, block_size)
    return (blocks * absmax[:, None]).flatten()[:numel].reshape(shape)


class NF4Linear(QuantizedLinear):
    def __init__(self, layer: nn.Linear, block_size: int) -> None:
        super().__init__(layer.in_features, layer.out_features, layer.bias)
        self.block_size = block_size
        packed, absmax = quantize_nf4(layer.weight, block_size)
        self.register_buffer("qweight", packed)
        self.register_buffer("absmax", absmax)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        return dequantize_nf4(self.qweight, self.absmax, shape, self.block_size).to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}"


class NF4Method(QuantizationMethod):
    name = "nf4"

    def config_keys(self) -> tuple[str, ...]:
        return ("block_size",)

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        self.block_size = self.config.get("block_size", DEFAULT_BLOCK_SIZE)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"nf4 block_size must be a positive int, got {self.block_size!r}")
        self._warned = False

    def quantize_linear(self, name: str, layer: nn.Linear) -> QuantizedLinear:
        if not self._warned:
            logger.warning("quantization=nf4 has no kernel: every call dequantizes the whole weight, so it "
                           "decodes slower than the unquantized model; it saves memory. For speed use int4 "
                           "(its quality costs: BENCHMARKS.md, section Quality)")
            self._warned = True
        return NF4Linear(layer, self.block_size)
