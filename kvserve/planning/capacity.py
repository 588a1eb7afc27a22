"""What a model needs on a device: weights, KV cache blocks, concurrent sequences and the
bandwidth and compute floors of a workload, sized by the engine's own code (the model built
on the meta device, so no weight is allocated)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvserve.benchmarks.roofline import attention_flops_per_key, linear_flops_per_token
from kvserve.config import ModelConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.model_executor.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    blocks_in_budget,
    kv_bytes_per_token,
    kv_cache_bytes_per_block,
)
from kvserve.model_executor.model_bytes import (
    decode_step_weight_bytes,
    expert_weight_bytes,
    resident_weight_bytes,
    weight_bytes_per_step,
)
from kvserve.model_executor.models.registry import get_model_class
from kvserve.model_executor.tensor_parallel import check_shardable, rank_config, vocab_rows_per_rank
from kvserve.planning.devices import DeviceSpec
from kvserve.quantization import get_quantization_method, quantize_model

# Methods whose bytes the planner cannot know from the shape alone: they depend on a GGUF
# file's own block types or on what `auto` picks for it.
_UNPLANNED_QUANTIZATION = ("auto", "gguf")


@dataclass(frozen=True)
class PlanOptions:
    """The engine flags that size memory, and the workload (lengths of one request)."""

    tensor_parallel_size: int = 1
    dtype: str = "auto"
    quantization: str | None = None
    quantization_config: dict | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    kv_cache_memory: int | None = None  # the CPU budget; None: the engine's default
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the per-device default of `serve`
    input_len: int = 1024
    output_len: int = 256
    concurrency: int | None = None  # sequences that must fit at once, if any

    def __post_init__(self) -> None:
        positive = {"--tensor-parallel-size": self.tensor_parallel_size, "--block-size": self.block_size,
                    "--max-num-seqs": self.max_num_seqs, "--input-len": self.input_len,
                    "--output-len": self.output_len, "--concurrency": self.concurrency or 1}
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class Plan:
    """Bytes are per rank unless named total; floors are seconds on `device`."""

    model: str
    device: str
    device_source: str
    tensor_parallel_size: int
    dtype: str
    kv_cache_dtype: str
    quantization: str | None
    weight_bytes: int  # everything resident: parameters and buffers
    weight_bytes_per_step: int  # what a batch-1 decode step reads of them
    activation_peak_bytes: int  # GPU: estimate of the profiled step's transients
    kv_bytes_per_token: int
    kv_bytes_per_token_total: int  # all ranks
    kv_budget_bytes: int
    num_blocks: int
    block_size: int
    max_model_len: int
    input_len: int
    output_len: int
    request_tokens: int
    request_kv_bytes_total: int
    concurrent_sequences: int  # requests of request_tokens the cache holds at once
    running_sequences: int  # the same, capped by max_num_seqs
    decode_step_floor_s: float  # one step at running_sequences, mean context of the request
    decode_step_floor_batch1_s: float
    decode_output_tok_s: float  # running_sequences / decode_step_floor_s
    prefill_floor_s: float  # one prompt of input_len
    problems: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rank_shape(config: ModelConfig, tp: int) -> ModelConfig:
    """A whole model of one rank's size: its heads, MLP and expert rows and (padded)
    vocabulary rows; building it gives exactly the tensors a rank keeps after sharding
    (tensor parallelism; expert parallelism is not planned)."""
    if tp == 1:
        return config
    check_shardable(config, tp)
    return replace(rank_config(config, tp), intermediate_size=config.intermediate_size // tp,
                   moe_intermediate_size=config.moe_intermediate_size // tp,
                   shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp,
                   vocab_size=vocab_rows_per_rank(config.vocab_size, tp))


def _rank_model(shape: ModelConfig, quantization: str | None, quantization_config: dict | None) -> torch.nn.Module:
    method = get_quantization_method(quantization, quantization_config)
    with torch.device("meta"):
        model = get_model_class(shape.architecture)(shape).to(shape.dtype)
    if method is not None:  # the engine's quantizers run on meta tensors too
        quantize_model(model, method)
    return model


def activation_peak_bytes(shape: ModelConfig, num_tokens: int, num_sampled: int) -> int:
    """An estimate of the memory profile's transients (GPU): one layer's widest point for a
    step of `num_tokens` (the residual stream and its normed copy, plus either q/k/v and the
    attention output, or gate/up and the activation), and the logits of `num_sampled` rows
    in the run dtype and as fp32."""
    element = torch.empty((), dtype=shape.dtype).element_size()
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    h, i = shape.hidden_size, shape.moe_intermediate_size or shape.intermediate_size
    layer = num_tokens * element * (2 * h + max(2 * q + 2 * kv, 3 * i))
    return layer + num_sampled * shape.vocab_size * (element + 4)


def plan(config: ModelConfig, name: str, device: DeviceSpec, options: PlanOptions) -> Plan:
    """`config` in any dtype: the run dtype is resolved here as the engine resolves it."""
    if options.quantization in _UNPLANNED_QUANTIZATION:
        raise ValueError(f"--quantization {options.quantization} depends on the file's own blocks; "
                         "name the method to plan for (int8, int4, nf4 or fp8), or none")
    quantization = None if options.quantization == "none" else options.quantization
    args = EngineArgs(dtype=options.dtype, kv_cache_dtype=options.kv_cache_dtype,
                      max_num_batched_tokens=options.max_num_batched_tokens)
    torch_device = torch.device(device.kind)
    dtype = args.resolved_dtype(torch_device)
    kv_dtype = args.resolved_kv_cache_dtype() or dtype
    config = replace(config, dtype=dtype)
    tp = options.tensor_parallel_size
    shape = _rank_shape(config, tp)
    model = _rank_model(shape, quantization, options.quantization_config)
    weight_bytes = resident_weight_bytes(model)
    step_bytes = weight_bytes_per_step(model, shape)
    experts_bytes = expert_weight_bytes(model)
    bytes_per_block = kv_cache_bytes_per_block(shape, options.block_size, kv_dtype)
    problems: list[str] = []

    activations = 0
    if device.kind == "cuda":
        num_tokens = args.resolved_max_num_batched_tokens(torch_device)
        activations = activation_peak_bytes(shape, num_tokens, min(options.max_num_seqs, num_tokens))
        budget = int(device.memory_bytes * options.gpu_memory_utilization) - (weight_bytes + activations)
    else:
        budget = options.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
        # CPU ranks share the host: each holds its weights and may grow to its whole budget.
        if tp * (weight_bytes + budget) > device.memory_bytes:
            problems.append(f"{tp} x (weights {weight_bytes / 1e9:.2f} GB + KV budget {budget / 1e9:.2f} GB) "
                            f"exceed the {device.memory_bytes / 1e9:.1f} GB of memory")
    try:
        num_blocks = blocks_in_budget(budget, bytes_per_block, options.block_size)
    except ValueError:
        num_blocks = 0
        problems.append(f"weights ({weight_bytes / 1e9:.2f} GB a rank) and activations leave "
                        f"{max(budget, 0) / 1e9:.2f} GB, not one KV block")

    max_model_len = options.max_model_len or config.max_position_embeddings
    request_tokens = options.input_len + options.output_len
    if request_tokens > max_model_len:
        problems.append(f"a request of {request_tokens} tokens exceeds max_model_len {max_model_len}")
    concurrent = num_blocks // math.ceil(request_tokens / options.block_size)
    if num_blocks and not concurrent:
        problems.append(f"the KV cache holds {num_blocks * options.block_size} tokens, "
                        f"less than one request of {request_tokens}")
    if options.concurrency is not None and concurrent < options.concurrency:
        problems.append(f"{options.concurrency} sequences of {request_tokens} tokens need "
                        f"{options.concurrency * math.ceil(request_tokens / options.block_size)} blocks; "
                        f"the cache has {num_blocks}")
    running = min(concurrent, options.max_num_seqs)

    kv_token = kv_bytes_per_token(shape, kv_dtype)
    mean_context = options.input_len + options.output_len / 2

    def decode_s(batch: int) -> float:
        weights = decode_step_weight_bytes(step_bytes, experts_bytes, shape, batch)
        return (weights + kv_token * batch * mean_context) / device.bandwidth

    prompt = options.input_len
    prefill_flops = (linear_flops_per_token(shape) * prompt
                     + attention_flops_per_key(shape) * prompt * (prompt + 1) // 2)
    step_s = decode_s(max(running, 1))
    return Plan(
        model=name, device=device.name, device_source=device.source, tensor_parallel_size=tp,
        dtype=_dtype_name(dtype), kv_cache_dtype=_dtype_name(kv_dtype), quantization=quantization,
        weight_bytes=weight_bytes, weight_bytes_per_step=step_bytes, activation_peak_bytes=activations,
        kv_bytes_per_token=kv_token, kv_bytes_per_token_total=kv_token * tp,
        kv_budget_bytes=max(budget, 0), num_blocks=num_blocks, block_size=options.block_size,
        max_model_len=max_model_len, input_len=options.input_len, output_len=options.output_len,
        request_tokens=request_tokens,
        request_kv_bytes_total=kv_token * tp * request_tokens,
        concurrent_sequences=concurrent, running_sequences=running,
        decode_step_floor_s=step_s, decode_step_floor_batch1_s=decode_s(1),
        decode_output_tok_s=max(running, 1) / step_s,
        prefill_floor_s=max(decode_step_weight_bytes(step_bytes, experts_bytes, shape, options.input_len)
                            / device.bandwidth, prefill_flops / device.peak_flops),
        problems=problems,
    )
