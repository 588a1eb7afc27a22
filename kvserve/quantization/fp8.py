"""fp8: float8_e4m3fn weights with fp32 scales per output channel (or per group of input
elements, as block-wise fp8 checkpoints store them).

Where the product runs:
* CPU: the weight upcast to the activation dtype (fp32 there); per-channel scales
  commute with the matmul, so only the output is scaled.
* Hopper (>= 9.0), per-channel scales, bf16/fp16 x of 2-128 rows (decode batches):
  x quantized to fp8 per token (dynamic scales, one Triton kernel) and kvserve's split-K
  W8A8 kernel on the fp8 tensor cores (kvserve/ops/quant/fp8_w8a8.py), where it beats cuBLAS and the
  weight-only kernels.
* CUDA (capability >= 8.9), one row on Hopper and up to 64 on Ada (decode): the Triton
  weight-only kernels read the fp8 bytes once and upcast them in the loop, where
  `torch._scaled_mm` reads the weight at well under the bandwidth (BENCHMARKS.md, "Kernel
  level (GPU)").
* CUDA (>= 8.9), more rows (prefill), bf16, per-channel scales: the same per-token
  quantization and `torch._scaled_mm` on the fp8 tensor cores.
* Otherwise (older GPUs, fp16 prefill, block scales) the weight is dequantized to the
  activation dtype per call.

At one decode row on CUDA the RMSNorms between linears run inside them (PendingNorm):
mma.sync leaves the next norm pending in its epilogue, mma.sync and the byte kernel finish
it by scaling their output rows. At 2-128 rows on Hopper the RMSNorm and SwiGLU kernels
before qkv, gate/up and down quantize their own output (Fp8Rows, `takes_fp8_rows`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.ops.quant.fp8_rows import Fp8Rows
from kvserve.quantization.base import KernelWeight, QuantizationMethod, QuantizedLinear, lm_head_as_linear
from kvserve.quantization.int8 import add_int8_lm_head

if TYPE_CHECKING:
    from kvserve.ops.pending_norm import PendingNorm
    from kvserve.ops.quant.weight_only.configs import LaunchConfig

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], scale fp32 [N]) with weight ~= q * scale[:, None]: each
    row's absolute maximum maps to the largest e4m3 value."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    q = (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    """Ada / Hopper (8.9+) have fp8 tensor cores for _scaled_mm and e4m3 conversions in Triton;
    fp8_w8a8's wgmma tiles were measured on Hopper (9.0+) only."""
    return torch.cuda.get_device_capability(device_index)


class Fp8Linear(QuantizedLinear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        """q float8_e4m3fn [N, K]; scale fp32 [N, G] (G = 1: per output channel)."""
        super().__init__(q.shape[1], q.shape[0], bias)
        if q.dtype != FP8_DTYPE or scale.dim() != 2 or scale.shape[0] != q.shape[0] or q.shape[1] % scale.shape[1]:
            raise ValueError(f"Fp8Linear needs float8_e4m3fn q [N, K] and scales [N, G] with G dividing K, "
                             f"got {q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}")
        self.group_size = q.shape[1] // scale.shape[1]
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.in_features

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.qweight.shape
        groups = self.qweight.reshape(n, -1, self.group_size).float() * self.scale[..., None]
        return groups.reshape(n, k).to(dtype)

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # fp16's range is too small for unscaled products (|q| up to 448 over long rows).
        if not self.per_channel or x.dtype == torch.float16:
            return super().dense_matmul(x)
        # e4m3 values are exact in bf16/fp32: convert only, scale the output.
        return F.linear(x, self.qweight.to(x.dtype)) * self.scale[:, 0].to(x.dtype)

    def gpu_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        weight = self.kernel_weight(x.device)
        if weight is None:
            return None  # dequantize instead
        w8a8 = self._w8a8_config(x)
        if w8a8 is not None:
            return self._w8a8(x, w8a8)
        if self.gpu_kernel_applies(x):
            from kvserve.ops.quant.weight_only import weight_only_matmul

            return weight_only_matmul(x, *weight[:4])
        if self._scaled_mm_applies(x):
            return self._scaled_mm(x)
        return None

    def kernel_weight(self, device: torch.device) -> KernelWeight | None:
        if device.type != "cuda" or _capability(device.index or 0) < (8, 9):
            return None  # no e4m3 conversions in Triton below 8.9
        return KernelWeight(self.qweight, self.scale, None, self.group_size, four_bit=False)

    def _w8a8_config(self, x: torch.Tensor) -> LaunchConfig | None:
        """fp8_w8a8's launch configuration for x, or None where it does not run x."""
        return self._w8a8_rows_config(x.numel() // self.in_features, x.dtype, x.device)

    def _w8a8_rows_config(self, rows: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig | None:
        if not (self.gpu_kernels and self.per_channel and device.type == "cuda"
                and dtype in (torch.bfloat16, torch.float16) and _capability(device.index or 0) >= (9, 0)):
            return None
        from kvserve.ops.quant.fp8_w8a8 import w8a8_config

        return w8a8_config(rows, self.out_features, self.in_features)

    def takes_fp8_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """Where `rows` rows of `dtype` x run on fp8_w8a8."""
        return self._w8a8_rows_config(rows, dtype, self.qweight.device) is not None

    def apply(self, x: torch.Tensor | PendingNorm | Fp8Rows) -> torch.Tensor:
        if not isinstance(x, Fp8Rows):
            return super().apply(x)
        config = self._w8a8_rows_config(x.values.shape[0], x.dtype, x.values.device)
        if config is None:  # only where takes_fp8_rows promised what this layer now declines
            return super().apply(x.dequantize())
        y = self._w8a8_rows(x, config)
        return y if self.bias is None else y + self.bias

    def _w8a8(self, x: torch.Tensor, config: LaunchConfig) -> torch.Tensor:
        """fp8_w8a8 on x quantized here (per token, one kernel)."""
        from kvserve.ops.quant.fp8_activation import quantize_per_token

        rows = x.reshape(-1, self.in_features)
        fp8_rows = Fp8Rows(*quantize_per_token(rows if rows.stride(-1) == 1 else rows.contiguous()), x.dtype)
        return self._w8a8_rows(fp8_rows, config).reshape(*x.shape[:-1], self.out_features)

    def _w8a8_rows(self, x: Fp8Rows, config: LaunchConfig) -> torch.Tensor:
        from kvserve.ops.quant.fp8_w8a8 import fp8_w8a8_matmul

        return fp8_w8a8_matmul(x.values, x.scales, self.qweight, self.scale, config, out_dtype=x.dtype)

    def _scaled_mm_applies(self, x: torch.Tensor) -> bool:
        # Row-wise scaled _scaled_mm: bf16 output, both dims multiples of 16.
        return (self.gpu_kernels and self.per_channel and x.dtype == torch.bfloat16
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        from kvserve.ops.quant.fp8_activation import quantize_per_token

        rows = x.reshape(-1, self.in_features)
        x_fp8, x_scale = quantize_per_token(rows if rows.stride(-1) == 1 else rows.contiguous())
        # qweight [N, K] row-major is the column-major [K, N] operand _scaled_mm wants. Fast
        # accumulation (no periodic promotion of the tensor cores' partial sums): on an H100
        # 12% less time at 192 rows, and an error of 5-9e-3 of the output's maximum against
        # the fp64 product of the same fp8 operands, where quantizing x and w to e4m3 already
        # costs 3-4e-2 (BENCHMARKS.md, "Kernel level (GPU)").
        y = torch._scaled_mm(x_fp8, self.qweight.t(), scale_a=x_scale, scale_b=self.scale.view(1, -1),
                             out_dtype=x.dtype, use_fast_accum=True)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class Fp8Method(QuantizationMethod):
    """e4m3 linears with per-channel scales, and an int8 copy of the LM head for decode-sized
    inputs (QuantizationMethod.lm_head_format: by default on CUDA and for fp32 heads on CPU;
    int8 keeps the head closer than e4m3 for the same bytes); `quantization_config={"lm_head":
    false}` keeps only the float head."""

    name = "fp8"

    def config_keys(self) -> tuple[str, ...]:
        return ("lm_head",)

    def quantize_lm_head(self, model: nn.Module) -> None:
        if self.lm_head_format(lm_head_as_linear(model).weight) == "int8":
            add_int8_lm_head(self, model)

    def quantize_linear(self, name: str, layer: nn.Linear) -> QuantizedLinear:
        q, scale = quantize_fp8(layer.weight)
        return Fp8Linear(q, scale[:, None], layer.bias)
