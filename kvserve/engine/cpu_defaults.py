"""What `--quantization auto` (the `kvserve serve` default) resolves to, and why.

On CPU a decode step is bound by the weight bytes it reads and by per-op overhead; prefill
is bound by fp32 GEMM throughput (bf16 GEMMs with more than one row are ~100x slower on
CPUs without AMX, see WORKLOADS.md). Measured on the 2-core development machine
(benchmarks/results/cpu_profile.md):

* A GGUF whose linear weights are all Q4_0/Q4_1 (the embedded SmolLM2 is Q4_1) is re-packed
  as int4 with group 32 and float zero points: that reproduces the file's grid exactly
  (perplexity identical to the dequantized fp32 weights, BENCHMARKS.md) and cuts the bytes
  of a 1-row step 4x; torch's int4 kernel runs decode-sized batches (<= 16 rows).
* A dequantized fp32 copy of those weights is kept for prefill-sized inputs, where
  dequantizing per call would cost more than the GEMM.
* The LM head (SmolLM2's tied embedding: 113 MB in fp32) gets an int8 per-channel copy for
  decode rows: about 2.5x less time per step on it at one row. (The file stores it as Q8_0.)
* Anything else, and every GPU run, keeps the weights in the run dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the CLI imports this module while building its parser: keep it light
    from kvserve.model_executor.loader import LoadedModel

logger = logging.getLogger(__name__)

AUTO = "auto"
NONE = "none"  # explicit "no quantization", e.g. to override serve's auto default
# GGUF block types whose values an int4 group-32 grid with float zero points holds exactly.
_INT4_EXACT_GGUF_TYPES = {"Q4_0", "Q4_1"}
_LINEAR_TENSOR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                           "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@dataclass
class AutoPlan:
    quantization: str | None = None
    quantization_config: dict[str, Any] | None = None
    keep_dense_weights: bool = False
    quantize_lm_head: bool = False
    reasons: list[str] = field(default_factory=list)


def resolve_auto_quantization(loaded: LoadedModel, device: torch.device) -> AutoPlan:
    """The plan for a model loaded in the run dtype (no quantization yet)."""
    if device.type != "cpu":
        return AutoPlan(reasons=[f"device {device.type}: weights stay in the run dtype"])
    types = {kind for name, kind in loaded.gguf_tensor_types.items() if name.endswith(_LINEAR_TENSOR_SUFFIXES)}
    if not types:
        return AutoPlan(reasons=["not a GGUF model: weights stay fp32 (bit-exact with transformers)"])
    if not types <= _INT4_EXACT_GGUF_TYPES:
        return AutoPlan(reasons=[f"GGUF linear types {sorted(types)} are not all Q4_0/Q4_1: weights stay fp32"])
    return AutoPlan(
        quantization="int4", quantization_config={"group_size": 32},
        keep_dense_weights=True, quantize_lm_head=True,
        reasons=[
            f"CPU + GGUF {'/'.join(sorted(types))} linears: int4 group 32 reproduces the file's grid "
            "exactly and reads 4x fewer bytes per decode step (torch int4 kernel for <= 16 rows)",
            "fp32 linears kept for prefill-sized inputs (fp32 GEMMs are the fast path there)",
            "int8 copy of the LM head for decode rows (4.7x less CPU time than its fp32 GEMV at one row)",
        ],
    )


@torch.no_grad()
def apply_plan(loaded: LoadedModel, plan: AutoPlan) -> None:
    """Quantize the loaded float model as planned, keeping its float linears for prefill."""
    from kvserve.quantization import get_quantization_method, quantize_model
    from kvserve.quantization.base import QuantizedLinear
    from kvserve.quantization.int8 import quantize_lm_head

    model = loaded.model
    if plan.quantization is not None:
        float_weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        report = quantize_model(model, get_quantization_method(plan.quantization, plan.quantization_config))
        logger.info("quantization=auto: %s, linear weights %.1f MB -> %.1f MB (%d layers)", report.method,
                    report.bytes_before / 1e6, report.bytes_after / 1e6, report.num_layers)
        if plan.keep_dense_weights:
            for name, module in model.named_modules():
                if isinstance(module, QuantizedLinear):
                    module.keep_dense_weight(float_weights[name])
    if plan.quantize_lm_head and quantize_lm_head(model) is None:
        logger.info("quantization=auto: the LM head's shape has no int8 kernel; it stays in the run dtype")
