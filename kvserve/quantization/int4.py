"""int4: asymmetric group-wise weight-only quantization with FLOAT zero points.

Each group of `group_size` input elements of a row keeps an fp32 scale and an fp32
minimum: w ~= q * scale + minimum, q in [0, 15] (on CUDA both are stored in fp16 where that
keeps them to fp16's precision, on the CPU kernel where fp16 holds them exactly:
Int4Linear.compact_scales). Float zero points (rather than an
integer q-offset) reproduce a llama.cpp Q4_1 grid exactly when the groups line up (the
embedded SmolLM2 is Q4_1 with 32-wide blocks); integer zero points cost about +25%
perplexity there. torch's CPU kernel uses the same convention, w = (q - 8) * s + z,
so it takes z = minimum + 8 * s.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from kvserve.ops.cpu import int4_matmul_op
from kvserve.quantization.base import KernelWeight, QuantizationMethod, QuantizedLinear, lm_head_as_linear
from kvserve.quantization.int8 import add_int8_lm_head

logger = logging.getLogger(__name__)

DEFAULT_GROUP_SIZES = (128, 64, 32)
_KERNEL_GROUP_SIZES = (32, 64, 128, 256)
# The CPU kernel's packed layout interleaves blocks of rows: 64 where torch runs its AVX-512
# code, 32 under AVX2.
_KERNEL_BLOCK_SIZES = (64, 32)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in [0, 15], scale [N, K/g], minimum [N, K/g]), all fp32 maths."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    minimum = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - minimum) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: q = 0
    q = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, minimum


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    groups = q.reshape(n, scale.shape[1], -1).to(torch.float32)
    return torch.addcmul(minimum.float()[..., None], groups, scale.float()[..., None]).reshape(n, k)


def fits_fp16(values: torch.Tensor) -> bool:
    """Every value survives a round trip through fp16 within fp16's relative precision
    (2^-11): no overflow, and no value so small that it loses bits as a subnormal."""
    error = (values.half().float() - values).abs()
    return bool((error <= values.abs() * 2**-11).all())


def exact_in_fp16(values: torch.Tensor) -> bool:
    """Every value is an fp16 value."""
    return torch.equal(values.half().float(), values)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    flat = q.flatten()
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten()[: n * k].reshape(n, k)


def _unpack_kernel_layout(packed: torch.Tensor, n: int, k: int, block_n: int) -> torch.Tensor:
    # Byte j of a block of B rows at column c holds row j (low nibble) and row j + B/2 (high).
    blocks = packed.reshape(n // block_n, k, block_n // 2)
    rows = torch.cat([blocks & 15, blocks >> 4], dim=-1)
    return rows.permute(0, 2, 1).reshape(n, k)


@functools.cache
def kernel_block_rows() -> int | None:
    """Rows per block of the CPU kernel's packed layout on this CPU; None where the layout
    is none we can read back (the layout is torch-internal: only a verified one is used)."""
    q = torch.randint(0, 16, (64, 32), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    for block_n in _KERNEL_BLOCK_SIZES:
        if torch.equal(_unpack_kernel_layout(packed, 64, 32, block_n), q.to(torch.uint8)):
            return block_n
    return None


class Int4Linear(QuantizedLinear):
    """Plain nibble pairs (row-major, even k in the low nibble): the layout kvserve's CPU
    kernel and the GPU kernel read. Where kvserve's CPU kernel is not built (or the groups are
    not multiples of 32), torch's CPU kernel layout instead, if it applies (dense calls unpack
    it). 0.5 byte per weight either way. One SmolLM2 step's linears from memory on the 2-core
    EPYC, kvserve's kernel against torch's, ms: 1 row 6.4 / 12.6, 4 rows 21.6 / 23.4, 16 rows
    69.4 / 83.0."""

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int,
        bias: torch.Tensor | None,
    ) -> None:
        """q uint8 [N, K] in [0, 15], scale and minimum fp32 [N, K / group_size]."""
        super().__init__(q.shape[1], q.shape[0], bias)
        self.group_size = group_size
        self.register_buffer("scale", scale.float())
        self.register_buffer("minimum", minimum.float())
        # kvserve's own kernel (kvserve.ops.cpu), built here rather than in the first
        # (possibly compiled) call; for CPU weights only (CUDA ones run Triton), also on a
        # machine that has a GPU (--device cpu).
        own = int4_matmul_op() if q.device.type == "cpu" else None
        self.own_kernel = own if own is not None and group_size % 32 == 0 else None
        self.kernel_layout = self.own_kernel is None and self._try_kernel_layout(q)
        if not self.kernel_layout:
            self.register_buffer("qweight", _pack_nibbles(q))
        self.compact_scales()

    def compact_scales(self) -> None:
        """Scales and minimums in fp16, which the kernels widen to fp32 as they read them: in
        fp32 they are 11% of an int4-g128 layer's bytes and a third of a g32 one's, read
        beside the packed weights by every decode step. On CUDA when fits_fp16 holds for
        both; on kvserve's CPU kernel only when fp16 holds them exactly (GGUF Q4_1's d and m),
        so that CPU outputs do not move (SmolLM2's one-row steps: 1.15x a step's int4
        calls)."""
        if self.scale.dtype != torch.float32:
            return
        if self.scale.is_cuda:
            compact = fits_fp16(self.scale) and fits_fp16(self.minimum)
        else:
            compact = self.own_kernel is not None and exact_in_fp16(self.scale) and exact_in_fp16(self.minimum)
        if compact:
            self.scale, self.minimum = self.scale.half(), self.minimum.half()

    def _try_kernel_layout(self, q: torch.Tensor) -> bool:
        n, k = q.shape
        block_n = kernel_block_rows()
        if (self.group_size not in _KERNEL_GROUP_SIZES or block_n is None or n % block_n
                or q.device.type != "cpu"):
            return False
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # The layout is torch-internal: keep it only if we can read it back exactly.
        if not torch.equal(_unpack_kernel_layout(packed, n, k, block_n), q):
            return False
        self.kernel_block_n = block_n
        self.register_buffer("qweight", packed)
        zero = self.minimum + 8 * self.scale
        scales_and_zeros = torch.stack([self.scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("kernel_scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        return True

    @property
    def cpu_kernel(self) -> str | None:
        """Which fused CPU kernel takes decode rows: "kvserve", "torch" or None (dense)."""
        return "kvserve" if self.own_kernel is not None else "torch" if self.kernel_layout else None

    def _apply(self, fn, recurse: bool = True):  # every .to() / .cuda() of the module
        super()._apply(fn, recurse)
        if self.qweight.device.type != "cpu":
            self.own_kernel = None
        if self.kernel_layout and self.qweight.device.type != "cpu":
            # torch's CPU kernel layout means nothing elsewhere (a checkpoint's layers are
            # built on the CPU, then moved): plain nibble pairs are what the GPU kernel reads.
            q = self.unpacked()
            self.qweight = _pack_nibbles(q)
            del self.kernel_scales_and_zeros
            self.kernel_layout = False
        self.compact_scales()
        return self

    def unpacked(self) -> torch.Tensor:
        if self.kernel_layout:
            return _unpack_kernel_layout(self.qweight, self.out_features, self.in_features,
                                         self.kernel_block_n)
        return _unpack_nibbles(self.qweight, self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.unpacked(), self.scale, self.minimum).to(dtype)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.own_kernel is not None:
            y = self.own_kernel(x.reshape(-1, self.in_features).float(),
                                self._nibble_pairs(),
                                self.scale, self.minimum, self.group_size)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if not self.kernel_layout:
            return None
        # bf16 activations are the op's fast path; its scales and zeros are bf16 too.
        y = torch._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(torch.bfloat16), self.qweight,
            self.group_size, self.kernel_scales_and_zeros,
        )
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """On CUDA the weight is unpacked by one Triton pass (7x less time than the torch ops
        of `dequantize` for llama3-8b's linears on an H200), then cuBLAS."""
        y = None
        if not self.kernel_layout and self.in_features % 2 == 0:
            y = self.unpacked_matmul(x, self._nibble_pairs(), self.scale, self.minimum, self.group_size, four_bit=True)
        return super().dense_matmul(x) if y is None else y

    def _nibble_pairs(self) -> torch.Tensor:
        """The plain layout's weight as [N, K / 2] bytes, two nibbles each."""
        return self.qweight.view(self.out_features, self.in_features // 2)

    def kernel_weight(self, device: torch.device) -> KernelWeight | None:
        if self.in_features % 2:
            return None
        return KernelWeight(self._nibble_pairs(), self.scale, self.minimum, self.group_size, four_bit=True)

    def gpu_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        weight = self.kernel_weight(x.device)
        if weight is None or not self.gpu_kernel_applies(x):
            return None
        from kvserve.ops.quant.weight_only import weight_only_matmul

        return weight_only_matmul(x, *weight[:4], four_bit=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class Int4Method(QuantizationMethod):
    """Group-wise int4 linears, and an int8 copy of the LM head for decode-sized inputs
    (QuantizationMethod.lm_head_format: by default on CUDA and for fp32 heads on CPU): the
    float head is ~7% of a llama3-8b bf16 step's bytes but ~22% of an int4 step's.
    `quantization_config={"lm_head": "int4"}` (or true) makes the copy int4 (same group size
    rule; +4-8% perplexity on SmolLM2), false keeps only the float head, which always stays
    for the embedding lookup and for larger inputs (prefill's logits)."""

    name = "int4"
    own_lm_head_format = "int4"

    def config_keys(self) -> tuple[str, ...]:
        return ("group_size", "lm_head")

    def group_size(self, name: str, in_features: int) -> int:
        if "group_size" in self.config:
            group_size = self.config["group_size"]
            if not isinstance(group_size, int) or group_size <= 0 or in_features % group_size:
                raise ValueError(
                    f"int4 group_size {group_size!r} does not divide the input size "
                    f"{in_features} of layer {name!r}"
                )
            return group_size
        for group_size in DEFAULT_GROUP_SIZES:
            if in_features % group_size == 0:
                return group_size
        raise ValueError(
            f"int4: none of the default group sizes {DEFAULT_GROUP_SIZES} divides the input "
            f"size {in_features} of layer {name!r}; set quantization_config={{'group_size': N}}"
        )

    def check_layer(self, name: str, layer: nn.Linear) -> None:
        self.group_size(name, layer.in_features)

    def quantize_linear(self, name: str, layer: nn.Linear) -> QuantizedLinear:
        group_size = self.group_size(name, layer.in_features)
        return Int4Linear(*quantize_int4(layer.weight, group_size), group_size, layer.bias)

    def quantize_lm_head(self, model: nn.Module) -> None:
        layer = lm_head_as_linear(model)
        head_format = self.lm_head_format(layer.weight)
        if head_format == "int8":
            add_int8_lm_head(self, model)
        elif head_format == "int4":
            head = self.quantize_linear("lm_head", layer)
            head.keep_dense_weight(layer.weight, layer.weight.dtype, pack=False)  # the head itself: no copy
            model.quantized_lm_head = head
            logger.info("quantization=int4: an int4 copy of the LM head for decode (%.1f MB, group %d)",
                        head.weight_bytes() / 1e6, head.group_size)
