"""When a plan does not fit: the nearest changes that would (quantize, more ranks, a
shorter context), each planned in full."""

from __future__ import annotations

from dataclasses import replace

from kvserve.config import ModelConfig
from kvserve.planning.capacity import Plan, PlanOptions, plan
from kvserve.planning.devices import DeviceSpec

_QUANTIZATIONS = ("fp8", "int8", "int4")
_TENSOR_PARALLEL_SIZES = (2, 4, 8)


def _variants(config: ModelConfig, device: DeviceSpec, options: PlanOptions) -> list[tuple[str, PlanOptions]]:
    variants = []
    if options.kv_cache_dtype == "auto" and device.kind == "cuda":
        variants.append(("--kv-cache-dtype fp8", replace(options, kv_cache_dtype="fp8")))
    if options.quantization in (None, "none"):
        variants += [(f"--quantization {q}", replace(options, quantization=q)) for q in _QUANTIZATIONS
                     if q != "fp8" or device.kind == "cuda"]
    if device.kind == "cuda":
        variants += [(f"--tensor-parallel-size {tp}", replace(options, tensor_parallel_size=tp))
                     for tp in _TENSOR_PARALLEL_SIZES if tp > options.tensor_parallel_size]
    return variants


def suggestions(config: ModelConfig, name: str, device: DeviceSpec, options: PlanOptions,
                current: Plan) -> list[tuple[str, Plan]]:
    """(flags to change, the plan with them) for each single change that fits; a shorter
    context when the cache holds some blocks but not the workload's requests."""
    found = []
    for flags, variant in _variants(config, device, options):
        try:
            candidate = plan(config, name, device, variant)
        except ValueError:  # e.g. heads that this many ranks cannot split
            continue
        if candidate.fits:
            found.append((flags, candidate))
    # Each of the sequences asked for (at least one) gets an equal share of the blocks.
    share = current.num_blocks // (options.concurrency or 1) * current.block_size
    if options.output_len < share < current.request_tokens:
        shorter = replace(options, input_len=share - options.output_len, max_model_len=share)
        candidate = plan(config, name, device, shorter)
        if candidate.fits:
            found.append((f"--max-model-len {share} (prompts up to {shorter.input_len} tokens)", candidate))
    return found
