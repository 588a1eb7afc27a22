"""The quantization interface: a method turns each linear layer of a loaded model into a
`QuantizedLinear` that owns its packed weights and computes `apply(x) -> y`.

The model code builds plain `nn.Linear` layers and never learns which method is active:
`quantize_model` swaps them after the weights are in place. Methods that load packed
checkpoints (GGUF blocks, GPTQ/AWQ) plug in by building the same `QuantizedLinear`
subclasses from the checkpoint's tensors instead of from a float weight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import envs
from kvserve.ops.pending_norm import PendingNorm
from kvserve.quantization.batch_invariance import current_runs
from kvserve.quantization.cpu_dense import DenseWeight

# Measured on SmolLM2's linears (2-core AVX512 CPU, torch 2.13): torch's weight-only
# kernels with bf16 activations beat fp32 up to about 8 rows, break even near 16, and are
# ~2x slower than fp32 at 64 rows; dequantizing to fp32 per call costs about one 1-row
# fp32 pass over the weight extra, so it wins from there on.
CPU_KERNEL_MAX_ROWS = 16

# On CUDA, inputs of up to this many rows (bf16/fp16) run the Triton weight-only kernels
# (ops/quant/weight_only/), which read the packed weight once; more rows
# dequantize to the activation dtype per call and run cuBLAS (the crossover measured on an
# H200). fp8 layers use torch._scaled_mm for those instead (fp8.py).
GPU_KERNEL_MAX_ROWS = 64

# Layers left in the run dtype: the LM head decides every token, and embeddings are
# only gathered, so quantizing them saves memory but no decode time.
_SKIPPED_LAYERS = ("lm_head",)


class KernelWeight(NamedTuple):
    """A layer's weight as the Triton weight-only kernels take it (weight_only_matmul's
    arguments): qweight [N, K] int8 / float8_e4m3fn or [N, K / 2] nibble pairs (four_bit),
    scales and offsets per group of group_size inputs."""

    qweight: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    four_bit: bool


class QuantizedLinear(nn.Module, ABC):
    """A linear layer whose weight is stored quantized; the computation is picked per
    call by the number of rows: a fused weight-only kernel for decode-sized inputs on
    CPU or CUDA where the method has one, else dequantize to the activation dtype and run a
    dense matmul (no float copy of the weight is kept between calls)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # False (KVSERVE_QUANTIZED_GPU_KERNELS=0 when the layer is built): every CUDA call takes
        # the dequantize path, the reference the kernels are tested and benchmarked against.
        self.gpu_kernels = envs.KVSERVE_QUANTIZED_GPU_KERNELS

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, [out_features, in_features]."""

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T through a fused weight-only CPU kernel, or None where there is none."""
        return None

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T by dequantizing to the activation dtype: any device, any row count."""
        return F.linear(x, self.dequantize(x.dtype))

    def gpu_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T through a Triton kernel on CUDA, or None where the method has none or
        the input does not suit it."""
        return None

    @staticmethod
    def unpacked_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                        group_size: int, four_bit: bool) -> torch.Tensor | None:
        """x @ W^T on CUDA with the weight unpacked by one Triton pass to x's dtype (several
        times less time than `dequantize`'s torch ops), then cuBLAS: the dense
        path of layers whose packed weight unpack_weight reads (packed [N, K] int8 bytes or
        [N, K / 2] nibble pairs, scale and offset [N, K / group_size]). None where it does
        not apply."""
        if not x.is_cuda:
            return None
        from kvserve.ops.quant.weight_only import unpack_weight

        weight = unpack_weight(packed, scale, offset, group_size, x.dtype, four_bit=four_bit)
        return None if weight is None else F.linear(x, weight)

    # Rows up to which CUDA inputs take the Triton kernels (an LM head's copy lowers it).
    gpu_kernel_max_rows = GPU_KERNEL_MAX_ROWS

    def gpu_kernel_applies(self, x: torch.Tensor) -> bool:
        return self.gpu_kernel_takes(x.numel() // self.in_features, x.dtype)

    def gpu_kernel_takes(self, rows: int, dtype: torch.dtype) -> bool:
        """gpu_kernel_applies for `rows` rows of x in `dtype`."""
        return self.gpu_kernels and dtype in (torch.bfloat16, torch.float16) and rows <= self.gpu_kernel_max_rows

    # Rows up to which CPU inputs take the fused kernel (keep_dense_weight may lower it).
    cpu_kernel_max_rows = CPU_KERNEL_MAX_ROWS
    # A float copy of the weight for the dense path (keep_dense_weight); a plain attribute,
    # not a buffer: a packed weight is opaque to .to(), state_dict and torch.compile.
    dense_weight: DenseWeight | None = None

    # Batch-invariant (batch_invariance.py): CPU decode rows take the fused kernel at any row
    # count, and prompt rows (the runs a step names) the dense path.
    batch_invariant = False

    def decode_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T through the fused kernel for decode-sized CPU inputs (any size where
        batch-invariant) or the method's CUDA kernels, else None."""
        if x.device.type == "cpu" and (self.batch_invariant or x.numel() <= self.cpu_kernel_max_rows * self.in_features):
            return self.kernel_matmul(x)
        if x.is_cuda:
            return self.gpu_matmul(x)
        return None

    def keep_dense_weight(self, weight: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                          kernel_max_rows: int = CPU_KERNEL_MAX_ROWS, pack: bool = True) -> None:
        """Keep a float weight for the dense path (the original one, or else a dequantized
        copy), in `dtype` and (`pack`) oneDNN's blocked layout: inputs of more than
        `kernel_max_rows` rows then run a plain matmul in that dtype instead of dequantizing
        per call. Memory for speed; the CPU serving default (bf16 where the CPU's bf16 GEMMs
        are the fast ones, cpu_plan.py)."""
        weight = self.dequantize(torch.float32) if weight is None else weight.detach()
        self.dense_weight = DenseWeight(weight, dtype, pack)
        self.cpu_kernel_max_rows = kernel_max_rows

    def kernel_weight(self, device: torch.device) -> KernelWeight | None:
        """The weight as the Triton weight-only kernels take it on CUDA `device`, or None
        where the method's weights do not run them there (the fused RMSNorms below then
        decline)."""
        return None

    def _fusing_weight(self, x: torch.Tensor) -> KernelWeight | None:
        """kernel_weight for CUDA x of decode size (the kernels' rows and dtypes)."""
        return self.kernel_weight(x.device) if x.is_cuda and self.gpu_kernel_applies(x) else None

    # Fusion partners: what this layer's kernels take from the kernel before them and leave to
    # the kernel after them. RMSNorm.add_after asks a quantized linear through these; the
    # defaults decline, methods whose kernels can say where.

    def takes_fp8_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `rows` rows of `dtype` x run on a kernel that multiplies fp8 by fp8, so that
        the kernel producing x should quantize its output (Fp8Rows): fp8 weights on Hopper."""
        return False

    def folds_pending_norm(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether pending_matmul finishes a PendingNorm of `rows` rows in `dtype` in this
        layer's kernel: the linear before a norm leaves it pending only then."""
        stored = next(self.buffers(), None)
        if stored is None or not stored.is_cuda or not self.gpu_kernel_takes(rows, dtype):
            return False
        weight = self.kernel_weight(stored.device)
        if weight is None:
            return False
        from kvserve.ops.quant.weight_only.matmul import folds_pending_norm

        return folds_pending_norm(rows, dtype, stored.device, weight.qweight, weight.scale, weight.group_size,
                                  weight.four_bit)

    def pending_matmul(self, x: PendingNorm) -> torch.Tensor | None:
        """x @ W^T for x whose RMSNorm the previous linear left pending, finished in this
        layer's kernel (its output rows scaled), or None where the method's kernels cannot."""
        weight = self._fusing_weight(x.rows)
        if weight is None:
            return None
        from kvserve.ops.quant.weight_only import weight_only_matmul

        return weight_only_matmul(x.rows, *weight[:4], four_bit=weight.four_bit, pending=x)

    def add_norm_matmul(
        self, x: torch.Tensor | PendingNorm, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> PendingNorm | None:
        """RMSNorm.add_after's fused form: y = x @ W^T added to residual in place, the norm
        after it left pending, or None (nothing done) where the method's kernels cannot (a
        pending x included: the models hand a linear before a norm a finished input)."""
        if isinstance(x, PendingNorm):
            return None
        weight = self._fusing_weight(x)
        if weight is None or self.bias is not None:
            return None
        from kvserve.ops.quant.weight_only.matmul import AddNorm, weight_only_matmul_add_norm

        fused = weight_only_matmul_add_norm(x, *weight[:4], AddNorm(residual, norm_weight), four_bit=weight.four_bit)
        return None if fused is None else PendingNorm(*fused, eps)

    def apply(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            y = self.pending_matmul(x)
            if y is not None:
                return y if self.bias is None else y + self.bias
            x = x.finish()  # only where folds_pending_norm promised what pending_matmul declined
        # A compiled decode graph holds decode rows only: nothing to route.
        routes = (self.batch_invariant and x.dim() == 2 and x.device.type == "cpu"
                  and not torch.compiler.is_compiling())
        runs = current_runs(x.shape[0]) if routes else None
        if runs is not None:  # decode rows on the kernel, prompt rows on the dense path
            y = torch.cat([self._matmul(x[run.start : run.end], run.decode) for run in runs])
        else:
            y = self._matmul(x, decode=True)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        y = self.decode_matmul(x) if decode else None
        if y is not None:
            return y
        if self.dense_weight is not None:
            # The activations are cast, not the weight: a bf16 dense weight computes in bf16.
            return self.dense_weight.linear(x)
        return self.dense_matmul(x)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return self.apply(x)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def takes_fp8_rows(consumer: nn.Module | None, rows: int, dtype: torch.dtype) -> bool:
    """Whether `consumer` (the linear that takes a kernel's output; None: anything else) runs
    `rows` rows of `dtype` activations as Fp8Rows, so that their producer should quantize:
    a quantized linear that says so (QuantizedLinear.takes_fp8_rows); nothing else does."""
    return isinstance(consumer, QuantizedLinear) and consumer.takes_fp8_rows(rows, dtype)


class QuantizationMethod(ABC):
    """Decides, per linear layer, how its weight is converted and applied."""

    name: str
    # The LM head copy's format that `lm_head: true` asks for, besides int8 (lm_head_format).
    own_lm_head_format: str | None = None

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        config = dict(config or {})
        unknown = sorted(set(config) - set(self.config_keys()))
        if unknown:
            raise ValueError(
                f"quantization={self.name!r}: unknown quantization_config keys {unknown}; "
                f"supported: {sorted(self.config_keys()) or 'none'}"
            )
        self.config = config
        self.lm_head_format(None)  # a bad lm_head value fails here, before any layer is converted

    def config_keys(self) -> tuple[str, ...]:
        return ()

    def lm_head_format(self, head: torch.Tensor | None) -> str | None:
        """The format of the LM head's decode copy, from quantization_config["lm_head"]: false
        for none (None), true for the method's own format (own_lm_head_format, else int8), or a
        format by name ("int8", or own_lm_head_format). Where absent, int8 for a float head
        (`head`, its weight) on CUDA or in fp32 (CPU's run dtype): a quantized step's largest
        single read, which int8 per channel halves or quarters for +0.01% perplexity on SmolLM2
        (BENCHMARKS.md, "Quality"); else none. `head` None only checks the value."""
        formats = tuple(dict.fromkeys(f for f in (self.own_lm_head_format, "int8") if f))
        if "lm_head" not in self.config:
            return "int8" if head is not None and (head.is_cuda or head.dtype == torch.float32) else None
        value = self.config["lm_head"]
        if value is False or value is True:
            return formats[0] if value else None
        if value not in formats:
            raise ValueError(f"quantization={self.name!r}: lm_head must be true, false or one of "
                             f"{list(formats)}, got {value!r}")
        return value

    def check_layer(self, name: str, layer: nn.Linear) -> None:
        """Raise ValueError naming the layer if this method cannot quantize it."""

    @abstractmethod
    def quantize_linear(self, name: str, layer: nn.Linear) -> QuantizedLinear:
        """Build the quantized replacement of a loaded float layer."""

    def quantize_lm_head(self, model: nn.Module) -> None:
        """Add a quantized copy of the LM head where the method's config asks for it (by
        default the head stays in the run dtype)."""


def lm_head_as_linear(model: nn.Module) -> nn.Linear:
    """The model's LM head (its tied embedding where it has no separate head) as an
    nn.Linear sharing that weight tensor, for a method to quantize a copy of."""
    head = getattr(model, "lm_head", None)
    weight = head.weight if head is not None else model.model.embed_tokens.weight
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return layer


@dataclass
class QuantizationReport:
    method: str
    num_layers: int
    bytes_before: int
    bytes_after: int


@torch.no_grad()
def quantize_model(model: nn.Module, method: QuantizationMethod) -> QuantizationReport:
    """Swap every nn.Linear except the LM head for the method's quantized layer (the head
    only where the method says so); every layer is checked before any is converted, so a
    bad config leaves the model intact."""
    targets = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in _SKIPPED_LAYERS
    ]
    for name, layer in targets:
        method.check_layer(name, layer)
    bytes_before = bytes_after = 0
    for name, layer in targets:
        quantized = method.quantize_linear(name, layer)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, quantized)
        bytes_before += layer.weight.numel() * layer.weight.element_size()
        bytes_after += quantized.weight_bytes()
    method.quantize_lm_head(model)
    return QuantizationReport(method.name, len(targets), bytes_before, bytes_after)
