"""int8: symmetric weight-only quantization with one scale per output channel, or per group
of input columns (`quantization_config={"group_size": N}`)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.ops.cpu import int8_matmul_op
from kvserve.quantization.base import CPU_KERNEL_MAX_ROWS, QuantizationMethod, QuantizedLinear, lm_head_as_linear

logger = logging.getLogger(__name__)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K] in [-127, 127], scale fp32 [N]) with weight ~= q * scale[:, None]."""
    q, scale = quantize_int8_groups(weight, weight.shape[1])
    return q, scale[:, 0]


def quantize_int8_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K] in [-127, 127], scale fp32 [N, K / group_size]) with weight ~= q *
    scale per group of columns: symmetric, the group's largest |w| to 127. Weights on a Q8_0
    grid (GGUF: w = q d, d fp16, |q| = 127 somewhere in each 32-wide block, as llama.cpp's
    quantizer writes them) come back as exactly those q and d with 32-wide groups: a block's
    largest |w| is 127 d."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scale = groups.abs().amax(dim=2).clamp(min=1e-12) / 127
    q = groups / scale[..., None]
    q.round_().clamp_(-127, 127)  # in place: ~40% less time on a 128k-vocabulary LM head
    return q.to(torch.int8).reshape(n, k), scale


class Int8Linear(QuantizedLinear):
    def __init__(self, layer: nn.Linear) -> None:
        super().__init__(layer.in_features, layer.out_features, layer.bias)
        q, scale = quantize_int8(layer.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        # torch's CPU kernel wants bf16 scales and crashes on some odd K (seen at K=51).
        self.register_buffer("kernel_scale", scale.to(torch.bfloat16), persistent=False)
        self.has_kernel = self.in_features % 16 == 0
        # kvserve's own kernel for fp32 activations (kvserve.ops.cpu), built here rather than
        # in the first (possibly compiled) call; for CPU weights only (CUDA ones run Triton),
        # also on a machine that has a GPU (--device cpu).
        self.own_kernel = int8_matmul_op() if q.device.type == "cpu" else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.own_kernel is not None and x.dtype == torch.float32:
            y = self.own_kernel(x.reshape(-1, self.in_features), self.qweight, self.scale)
            return y.reshape(*x.shape[:-1], self.out_features)
        if not self.has_kernel:
            return None
        # With fp32 activations torch's op is slower than a fp32 matmul; bf16 is its fast path.
        y = torch._weight_int8pack_mm(
            x.reshape(-1, self.in_features).to(torch.bfloat16), self.qweight, self.kernel_scale
        )
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def gpu_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.gpu_kernel_applies(x):
            return None
        from kvserve.ops.quant.weight_only import weight_only_matmul

        return weight_only_matmul(x, self.qweight, self.scale[:, None], None, self.in_features)

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # Per-channel scales commute with the matmul: convert only, scale the output.
        return F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)


# The widest scale group kvserve's int8 CPU kernel sums in int32 before it scales (its
# kFlushColumns: 255 vectors of 16 products).
OWN_KERNEL_MAX_GROUP = 255 * 16


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                      group_size: int) -> torch.Tensor:
    """fp32 q [N, K] * scale [N, K / group_size] (+ offset) per group. In place on the one fp32
    copy: the same products and sums as with a temporary per step, 3-6x less time on a
    128k-vocabulary embedding."""
    n, k = q.shape
    groups = q.reshape(n, -1, group_size).to(torch.float32, copy=True)  # never q itself
    groups.mul_(scale[..., None])
    if offset is not None:
        groups.add_(offset[..., None])
    return groups.reshape(n, k)


class GroupInt8Linear(QuantizedLinear):
    """int8 q with an fp32 scale (and optional offset) per group of `group_size` input
    elements: w = q * scale + offset. Holds grids that per-channel int8 cannot express
    exactly (GGUF Q8_0/Q5_K/Q6_K, 8-bit GPTQ). On CPU, decode rows of groups of a multiple of
    16 columns (or whole rows), with or without offsets, run kvserve's int8 kernel; where it is
    not built, whole-row groups run torch's int8 kernel (one scale an output channel); other
    grids dequantize per call: on 2 CPU cores no loop-free grouped torch form (a batched bmm
    over groups, or the per-channel kernel on group-masked activations) beat that or fp32."""

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        if q.dtype != torch.int8 or q.shape[1] % group_size:
            raise ValueError(f"GroupInt8Linear needs int8 q with rows divisible by the group size "
                             f"{group_size}, got {q.dtype} {tuple(q.shape)}")
        self.group_size = group_size
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("offset", None if offset is None else offset.float().contiguous())
        self.has_kernel = group_size == self.in_features and self.in_features % 16 == 0
        if self.has_kernel:
            self.register_buffer("kernel_scale", self.scale[:, 0].to(torch.bfloat16), persistent=False)
        # kvserve's own kernel (fp32 activations) takes groups of a multiple of 16 columns (GGUF's
        # Q8_0, Q6_K and Q5_K); for CPU weights only (CUDA ones run Triton).
        kernel_groups = group_size == self.in_features or (group_size % 16 == 0 and group_size <= OWN_KERNEL_MAX_GROUP)
        self.own_kernel = int8_matmul_op() if kernel_groups and q.device.type == "cpu" else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_groups(self.qweight, self.scale, self.offset, self.group_size).to(dtype)

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """On CUDA the weight is unpacked by one Triton pass, then cuBLAS."""
        y = self.unpacked_matmul(x, self.qweight, self.scale, self.offset, self.group_size, four_bit=False)
        return super().dense_matmul(x) if y is None else y

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.reshape(-1, self.in_features)
        if self.own_kernel is not None and x.dtype == torch.float32:
            y = self.own_kernel(rows, self.qweight, self.scale, self.offset)
            return y.reshape(*x.shape[:-1], self.out_features)
        if not self.has_kernel:
            return None
        y = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight, self.kernel_scale).to(x.dtype)
        if self.offset is not None:  # a per-row offset adds offset * sum(x) to each output
            y = y + rows.sum(-1, keepdim=True) * self.offset[:, 0].to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def gpu_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.gpu_kernel_applies(x):
            return None
        from kvserve.ops.quant.weight_only import weight_only_matmul

        return weight_only_matmul(x, self.qweight, self.scale, self.offset, self.group_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class Int8Method(QuantizationMethod):
    """Per-channel int8 linears (`quantization_config={"group_size": N}`: one scale per N
    input columns, GroupInt8Linear; 32 holds GGUF Q8_0 weights exactly), and an int8 copy of
    the LM head for decode-sized inputs (QuantizationMethod.lm_head_format: by default on CUDA
    and for fp32 heads on CPU). On CPU the head is a fifth of SmolLM2's weight bytes: the copy
    makes single-stream decode ~1.25x faster and costs +0.01% perplexity (BENCHMARKS.md,
    "CPU decode steps" and "Quality"), as
    llama.cpp's 8-bit files keep their output matrix in Q8_0. `quantization_config={"lm_head":
    false}` leaves the head alone, `true` asks for the copy in any dtype."""

    name = "int8"

    def config_keys(self) -> tuple[str, ...]:
        return ("group_size", "lm_head")

    def check_layer(self, name: str, layer: nn.Linear) -> None:
        group_size = self.config.get("group_size")
        if group_size is not None and (not isinstance(group_size, int) or group_size <= 0
                                       or layer.in_features % group_size):
            raise ValueError(f"int8 group_size {group_size!r} does not divide the input size "
                             f"{layer.in_features} of layer {name!r}")

    def quantize_linear(self, name: str, layer: nn.Linear) -> QuantizedLinear:
        group_size = self.config.get("group_size")
        if group_size is None:
            return Int8Linear(layer)
        q, scale = quantize_int8_groups(layer.weight, group_size)
        return GroupInt8Linear(q, scale, None, group_size, layer.bias)

    def quantize_lm_head(self, model: nn.Module) -> None:
        if self.lm_head_format(lm_head_as_linear(model).weight) == "int8":
            add_int8_lm_head(self, model)


def add_int8_lm_head(method: QuantizationMethod, model: nn.Module) -> None:
    """The int8 LM head copy a method makes (quantize_lm_head); an error where the method's
    config asked for it and it cannot run, none where it was only the default."""
    if quantize_lm_head(model) is None and "lm_head" in method.config:
        raise ValueError(f"quantization={method.name!r} with lm_head: the LM head's input size is not "
                         "a multiple of 16, which torch's int8 CPU kernel needs")


# CUDA decode steps of up to this many rows take their logits from the int8 head; more rows
# (large batches, prompt logprobs) the float head through cuBLAS.
GPU_HEAD_MAX_ROWS = 16


@torch.no_grad()
def quantize_lm_head(model: nn.Module, dense_dtype: torch.dtype = torch.float32,
                     kernel_max_rows: int = CPU_KERNEL_MAX_ROWS) -> Int8Linear | None:
    """Attach an int8 copy of the LM head (the tied embedding where there is no separate
    head) for decode-sized inputs: on CUDA up to GPU_HEAD_MAX_ROWS rows, with the float head
    itself (no copy) for larger ones; on CPU up to `kernel_max_rows` rows, with the float
    weight in `dense_dtype` (the head's own tensor where that is its dtype, else a copy) for
    larger ones. Returns it, or None on CPU where the kernel does not apply."""
    layer = lm_head_as_linear(model)
    weight = layer.weight
    quantized = Int8Linear(layer)
    if weight.is_cuda:
        quantized.keep_dense_weight(weight, weight.dtype, pack=False)
        quantized.gpu_kernel_max_rows = GPU_HEAD_MAX_ROWS
    elif quantized.has_kernel:
        # An fp32 head stays the embedding's own tensor (shared, no copy); a bf16 copy is packed.
        quantized.keep_dense_weight(weight, dense_dtype, kernel_max_rows, pack=dense_dtype != weight.dtype)
    else:
        return None
    model.quantized_lm_head = quantized
    logger.info("an int8 copy of the LM head for decode (%.1f MB; quantization_config="
                "{\"lm_head\": false} keeps only the float head)", quantized.weight_bytes() / 1e6)
    return quantized
