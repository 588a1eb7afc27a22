"""What `--quantization auto` (the `kvserve serve` default) resolves to, and why.

On CPU a decode step is bound by the weight bytes it reads and by per-op overhead; prefill
is bound by GEMM throughput: fp32, or bf16 where the CPU has bf16 dot products (AVX512-BF16
~2x fp32, AMX 3-5x; without either a bf16 GEMM of more than one row is ~100x slower).
Measured on the 2-core development machines (benchmarks/results/cpu_profile.md):

* A GGUF whose linear weights are all Q4_0/Q4_1 (the embedded SmolLM2 is Q4_1) is re-packed
  as int4 with group 32 and float zero points: that reproduces the file's grid exactly
  (perplexity identical to the dequantized fp32 weights: BENCHMARKS.md, "Quality") and cuts
  the bytes of a 1-row step 4x; kvserve's int4 kernel (kvserve.ops.cpu) runs decode batches
  of up to INT4_FP32_FROM_ROWS rows (torch's where ours is not built), larger ones the fp32
  copy.
* One whose linears are all Q8_0 is re-packed as int8 with group 32 (quantize_int8_groups
  gives back the file's blocks exactly), ~3.6x fewer bytes than fp32; kvserve's int8 kernel
  runs decode batches of up to CPU_KERNEL_MAX_ROWS rows (a Q8_0 SmolLM2 decodes ~3x faster
  than on its fp32 weights at 1 and 16 rows: BENCHMARKS.md, "CPU decode steps").
* Any other mix of the block types quantization=gguf keeps packed (llama.cpp's K-quant mixes:
  Q4_K_M is Q4_K with Q6_K for some layers' v and down projections, and Q5_0/Q8_0 where rows
  are no multiple of 256) runs from the file's own blocks (PACKED_GGUF): 4-bit types as int4
  group 32, 5-bit ones (Q5_0/Q5_1/Q5_K) as int5 group 32 on the int4 kernel, Q6_K and Q8_0 as
  int8 groups, exactly; no re-quantization reproduces K-quant sub-block scales. A layer
  stacking 4- and 5-bit types is int5; one stacking a Q6_K v with Q4_K q and k is one int8
  layer at the narrowest group.
* A dequantized fp32 copy of those weights is kept for prefill-sized inputs, where
  dequantizing per call would cost more than the GEMM.
* The LM head (SmolLM2's tied embedding: 113 MB in fp32) gets an int8 per-channel copy for
  decode rows: about 2.5x less time per step on it at one row. (The file stores it as Q8_0.)
* Where the CPU's bf16 GEMMs are faster than its fp32 ones (AMX: 4-6x at 64-512 rows on a
  2-core Xeon; AVX512-BF16: ~2x on a 2-core EPYC), that dense copy is kept in bf16 instead
  (prefill 1.5-2x faster, half the memory), with a bf16 copy of the LM head, and both take
  every input of more than BF16_FROM_ROWS rows, decode batches included. Measured on the
  model's own shapes, since on CPUs without bf16 dot products the same bf16 GEMM is ~100x
  slower than fp32, at the first start on a CPU and kept (measured_bf16_speedup): a ratio
  near the threshold would otherwise pick bf16 at one start and fp32 at the next.
* The dense copies are packed in oneDNN's layout (quantization/cpu_dense.py).
* Anything else, and every GPU run, keeps the weights in the run dtype.
* All of the above starts from the fp32 dequantized model and keeps it (or its bf16 copy):
  about 4.5 bytes a parameter. A GGUF whose fp32 weights would take more than
  AUTO_DEQUANTIZE_MAX_FRACTION of the memory available at start (an 8B Q4_0 file: 32 GB)
  runs from its packed blocks instead (quantization=gguf: no fp32 copy; prefill-sized inputs
  dequantize per call, slower but within memory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvserve import envs
from kvserve.ops.cpu import cpu_flags
from kvserve.quantization.base import CPU_KERNEL_MAX_ROWS, QuantizedLinear

if TYPE_CHECKING:  # the CLI imports this module while building its parser: keep it light
    from kvserve.model_executor.loader import LoadedModel

logger = logging.getLogger(__name__)

AUTO = "auto"
NONE = "none"  # explicit "no quantization", e.g. to override serve's auto default
PACKED_GGUF = "gguf"  # the plan's method for a GGUF run from its own blocks (pack_gguf_linears)
# The most of the memory available at start that auto's fp32 dequantized weights may take;
# the rest is for its int4/int8 copies, the KV cache, activations and torch itself.
AUTO_DEQUANTIZE_MAX_FRACTION = 0.5
# GGUF block types whose values an int4 group-32 grid with float zero points holds exactly,
# and those a symmetric int8 group-32 grid does.
_INT4_EXACT_GGUF_TYPES = {"Q4_0", "Q4_1"}
_INT8_EXACT_GGUF_TYPES = {"Q8_0"}
# A GGUF's linear weights: attention, the MLP, and a mixture's experts (stacked, one tensor
# each in older Mixtral files, or Qwen2-MoE's shared one).
_LINEAR_TENSOR = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down)(_exps|_shexp|\.\d+)?)\.weight")
# bf16 dense weights are used where a bf16 GEMM (activation casts included) is at least this
# much faster than fp32 on the model's MLP shape: 3-5x with AMX, 1.9-2.4x with AVX512-BF16
# (2-core EPYC, probes of 16-256 rows), ~0.01x without either. On that EPYC the bf16 plan's
# SmolLM2 prefill took 0.64x the fp32 plan's time and its 8-16-row steps 0.62-0.85x
# (benchmarks/cpu_dense_plans.py, results/cpu-decode-smollm2/dense-plans-epyc.txt).
BF16_MIN_SPEEDUP = 1.5
_PROBE_ROWS = 64
# With fast bf16 GEMMs, inputs of more rows than this take the packed bf16 copies instead
# of the int4 (linears) and int8 (LM head) kernels. Over a SmolLM2 step's 120 linears, weights
# streamed from memory (AMX Xeon, 2 threads): int4 6.4 / 8.5 / 14.2 / 25.4 ms at 1 / 4 / 8 /
# 16 rows, packed bf16 13.3 / 11.8 / 11.7 / 12.2; the head: int8 1.6 vs bf16 2.1 ms at 4 rows,
# 3.2 vs 2.3 at 8. With AVX512-BF16 (2-core EPYC) whole decode steps at 8 rows were fastest
# with this limit too (cpu_dense_plans.py: 20.6 ms against 24.0 with 8).
BF16_FROM_ROWS = 4
# Without fast bf16: decode inputs of up to this many rows take the int4 linears' kernel, more
# rows the kept fp32 weights. One SmolLM2 step's linears from memory on a 2-core EPYC,
# kvserve's int4 kernel / torch's / fp32, ms: 1 row 6.4 / 12.6 / 23.9, 8 rows 38.1 / 40.2 /
# 44.7, 16 rows 69.4 / 83.0 / 59.0.
INT4_FP32_FROM_ROWS = 8


@dataclass
class AutoPlan:
    quantization: str | None = None
    quantization_config: dict[str, Any] | None = None
    keep_dense_weights: bool = False
    dense_dtype: torch.dtype = torch.float32
    quantize_lm_head: bool = False
    reasons: list[str] = field(default_factory=list)

    @property
    def linear_kernel_max_rows(self) -> int:
        """Rows up to which the quantized linears' kernel runs; more take the dense copies (a
        file's own blocks: the int4 layers' limit, int8 ones take CPU_KERNEL_MAX_ROWS)."""
        if self.dense_dtype == torch.bfloat16:
            return BF16_FROM_ROWS
        return INT4_FP32_FROM_ROWS if self.quantization in ("int4", PACKED_GGUF) else CPU_KERNEL_MAX_ROWS

    def kernel_max_rows(self, int4_kernel: bool) -> int:
        """linear_kernel_max_rows for a layer on the int4 kernel (int4, int5) or the int8 one:
        they cross over with fp32 at different row counts."""
        if int4_kernel or self.dense_dtype == torch.bfloat16:
            return self.linear_kernel_max_rows
        return CPU_KERNEL_MAX_ROWS

    @property
    def head_kernel_max_rows(self) -> int:
        """Rows up to which the int8 LM head runs (int8 stays ahead of fp32 up to 16 rows)."""
        return BF16_FROM_ROWS if self.dense_dtype == torch.bfloat16 else CPU_KERNEL_MAX_ROWS


def bf16_gemm_speedup(in_features: int, out_features: int, rows: int = _PROBE_ROWS) -> float:
    """fp32 time / bf16 time of one [rows, in] x [in, out] GEMM on this CPU, the bf16 one
    with its activation casts; a few milliseconds of measuring."""
    torch.manual_seed(0)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    weight_bf16 = weight.to(torch.bfloat16)

    def best_of(fn, repeats: int = 5) -> float:
        fn()  # first call: kernel selection, page faults
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best_of(lambda: torch.nn.functional.linear(x, weight))
    bf16 = best_of(lambda: torch.nn.functional.linear(x.to(torch.bfloat16), weight_bf16).float())
    return fp32 / bf16


def measured_bf16_speedup(in_features: int, out_features: int) -> float:
    """bf16_gemm_speedup, measured once per CPU, torch version, thread count and shape and
    kept in $KVSERVE_CACHE_DIR/cpu_probes.json, so every start on one machine makes one plan."""
    key = hashlib.sha1(f"{cpu_flags()}|{torch.__version__}|{torch.get_num_threads()}|"
                       f"{in_features}x{out_features}".encode()).hexdigest()[:16]
    path = envs.KVSERVE_CACHE_DIR / "cpu_probes.json"
    try:
        probes = json.loads(path.read_text())
    except (OSError, ValueError):
        probes = {}
    if isinstance(probes.get(key), float):
        return probes[key]
    probes[key] = speedup = bf16_gemm_speedup(in_features, out_features)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(probes))
        partial.replace(path)  # atomic: a concurrent start reads the old file or this one
    except OSError as error:
        logger.warning("could not keep the bf16 probe's result in %s (%s): it is measured again "
                       "at the next start", path, error)
    return speedup


def available_memory_bytes() -> int | None:
    """Memory a new allocation can get without swapping: MemAvailable (Linux, counting
    reclaimable page cache), else the free physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gguf_too_large_to_dequantize(path: str) -> str | None:
    """Why auto should run this GGUF from its packed blocks rather than dequantize it to
    fp32 (its fp32 weights would take more than AUTO_DEQUANTIZE_MAX_FRACTION of the memory
    available now), or None."""
    from kvserve.model_executor.gguf_loader import open_gguf

    fp32_bytes = 4 * sum(int(tensor.n_elements) for tensor in open_gguf(path).tensors)
    available = available_memory_bytes()
    if available is None or fp32_bytes <= AUTO_DEQUANTIZE_MAX_FRACTION * available:
        return None
    return (f"the dequantized model would take {fp32_bytes / 1e9:.1f} GB in fp32, more than "
            f"{AUTO_DEQUANTIZE_MAX_FRACTION:.0%} of the {available / 1e9:.1f} GB available: running the "
            "GGUF's packed blocks instead (quantization=gguf; no fp32 copy, so prefill-sized inputs "
            "dequantize per call)")


def resolve_auto_quantization(loaded: LoadedModel, device: torch.device) -> AutoPlan:
    """The plan for a model loaded in the run dtype (no quantization yet)."""
    if device.type != "cpu":
        return AutoPlan(reasons=[f"device {device.type}: weights stay in the run dtype"])
    types = {kind for name, kind in loaded.gguf_tensor_types.items() if _LINEAR_TENSOR.fullmatch(name)}
    if not types:
        return AutoPlan(reasons=["not a GGUF model: weights stay fp32 (bit-exact with transformers)"])
    from kvserve.quantization.gguf import SUPPORTED_TYPES

    if types <= _INT4_EXACT_GGUF_TYPES:
        method, grid = "int4", "int4 group 32 reproduces the file's grid exactly and reads 4x fewer bytes"
    elif types <= _INT8_EXACT_GGUF_TYPES:
        method, grid = "int8", "int8 group 32 reproduces the file's grid exactly and reads 3.6x fewer bytes"
    elif types <= {t.name for t in SUPPORTED_TYPES}:
        method, grid = PACKED_GGUF, "the file's own blocks as int4 / int8 group layers, exactly"
    else:
        return AutoPlan(reasons=[f"GGUF linear types {sorted(types)} include ones kvserve does not keep packed: "
                                 "weights stay fp32"])
    config = loaded.config
    speedup = measured_bf16_speedup(config.hidden_size, config.intermediate_size)
    fast_bf16 = speedup >= BF16_MIN_SPEEDUP
    # lm_head false: the plan makes the int8 head copy itself (apply_plan), with its own dense
    # dtype and row limit.
    plan = AutoPlan(
        quantization=method, keep_dense_weights=True,
        quantization_config=None if method == PACKED_GGUF else {"group_size": 32, "lm_head": False},
        dense_dtype=torch.bfloat16 if fast_bf16 else torch.float32, quantize_lm_head=True,
    )
    linear_rows, head_rows = plan.linear_kernel_max_rows, plan.head_kernel_max_rows
    probe = (f"a {_PROBE_ROWS}x{config.hidden_size}x{config.intermediate_size} bf16 GEMM measured "
             f"{speedup:.2f}x the fp32 one on this CPU, at its first start")
    dense_reason = (
        f"packed bf16 copies of the linears and the LM head for inputs of more than "
        f"{linear_rows} rows ({probe}: bf16 dot products)" if fast_bf16 else
        f"packed fp32 linears kept for inputs of more than {linear_rows} rows ({probe}: fp32 "
        "GEMMs are the fast path)"
    )
    kernels = (f"{method} kernel for <= {linear_rows} rows" if method != PACKED_GGUF else
               f"int4 kernel (4- and 5-bit) for <= {linear_rows} rows, int8 for <= "
               f"{plan.kernel_max_rows(int4_kernel=False)}")
    plan.reasons = [
        f"CPU + GGUF {'/'.join(sorted(types))} linears: {grid} per decode step ({kernels})",
        dense_reason,
        f"int8 copy of the LM head for up to {head_rows} rows "
        "(4.7x less CPU time than its fp32 GEMV at one row)",
    ]
    return plan


@torch.no_grad()
def apply_plan(loaded: LoadedModel, plan: AutoPlan,
               pack_linears: Callable[[LoadedModel], None] | None = None) -> None:
    """Quantize the loaded float model as planned, keeping its float linears for prefill. A
    PACKED_GGUF plan's layers come from the file's blocks: `pack_linears` (the loader's
    pack_gguf_linears: reading files is not this package's job) builds them."""
    from kvserve.quantization import get_quantization_method, quantize_model
    from kvserve.quantization.base import QuantizationReport
    from kvserve.quantization.int4 import Int4Linear
    from kvserve.quantization.int5 import Int5Linear
    from kvserve.quantization.int8 import quantize_lm_head

    model = loaded.model
    if plan.quantization is not None:
        float_weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        if plan.quantization == PACKED_GGUF:
            if pack_linears is None:
                raise ValueError("a plan to run a GGUF's own blocks needs the loader's packing (pack_gguf_linears)")
            float_bytes = {name: w.numel() * w.element_size() for name, w in float_weights.items()}
            # Each fp32 weight goes as its layer is packed, and the dense copies dequantize the
            # blocks (the same values): holding the fp32 model meanwhile took 9.4 GB, not 6.9,
            # for a 1B-parameter Q4_K_M file.
            float_weights = {}
            pack_linears(loaded)
            packed = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
            report = QuantizationReport(PACKED_GGUF, len(packed), sum(float_bytes[n] for n in packed),
                                        sum(m.weight_bytes() for m in packed.values()))
        else:
            report = quantize_model(model, get_quantization_method(plan.quantization, plan.quantization_config))
        logger.info("quantization=auto: %s, linear weights %.1f MB -> %.1f MB (%d layers)", report.method,
                    report.bytes_before / 1e6, report.bytes_after / 1e6, report.num_layers)
        if plan.keep_dense_weights:
            for name, module in model.named_modules():
                if isinstance(module, QuantizedLinear):
                    rows = plan.kernel_max_rows(int4_kernel=isinstance(module, (Int4Linear, Int5Linear)))
                    module.keep_dense_weight(float_weights.get(name), plan.dense_dtype, rows)
    if plan.quantize_lm_head and quantize_lm_head(model, plan.dense_dtype, plan.head_kernel_max_rows) is None:
        logger.info("quantization=auto: the LM head's shape has no int8 kernel; it stays in the run dtype")
