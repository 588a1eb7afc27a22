"""The floor of a decode step: the bytes it must move over the memory bandwidth measured here."""

from __future__ import annotations

import time

import torch

from kvserve.config import ModelConfig
from kvserve.model_executor.kv_sizing import kv_bytes_per_token
from kvserve.model_executor.model_bytes import decode_step_weight_bytes


def copy_bandwidth(device: torch.device, num_bytes: int | None = None, repeats: int = 10) -> float:
    """Bytes read plus bytes written per second by a large device-local copy (median)."""
    if num_bytes is None:
        num_bytes = 4 * 2**30 if device.type == "cuda" else 256 * 2**20
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / sorted(times)[len(times) // 2]


def decode_step_floor_s(weight_bytes: int, kv_bytes_per_tok: int, context_tokens: int, bandwidth: float) -> float:
    """Seconds a decode step needs at least: weights once plus the live KV of every sequence."""
    return (weight_bytes + kv_bytes_per_tok * context_tokens) / bandwidth


def matmul_peak_flops(device: torch.device, repeats: int = 10, float8: bool = False) -> float:
    """FLOP/s of a large square matmul in the device's compute dtype (bf16 on GPU, fp32 on
    CPU), median of repeats: the compute ceiling of a prefill-heavy step. float8: e4m3
    operands through torch._scaled_mm (the fp8 linears' prefill path; CUDA 8.9+)."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    if float8:
        one = torch.ones((), dtype=torch.float32, device=device)
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major

        def matmul() -> torch.Tensor:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        def matmul() -> torch.Tensor:
            return a @ b
    matmul()  # warm up
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        matmul()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def linear_flops_per_token(config: ModelConfig) -> int:
    """Multiply-adds x 2 of every linear layer and the LM head for one token: in a mixture
    of experts' layers, its router, the top_k experts it runs and the shared expert."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    h = config.hidden_size
    attention = h * (q + 2 * kv) + q * h
    dense_mlp = 3 * h * config.intermediate_size
    moe_layers = config.num_hidden_layers - len(config.dense_mlp_layers) if config.num_experts else 0
    moe_mlp = (h * config.num_experts + 3 * h * config.moe_intermediate_size * config.num_experts_per_tok
               + 3 * h * config.shared_expert_intermediate_size + h * bool(config.shared_expert_intermediate_size))
    mlps = (config.num_hidden_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
    return 2 * (config.num_hidden_layers * attention + mlps + h * config.vocab_size)


def attention_flops_per_key(config: ModelConfig) -> int:
    """QK^T and PV for one query token against one key, all layers and heads."""
    return 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim


def offline_floor_s(
    prompt_lens: list[int],
    output_lens: list[int],
    config: ModelConfig,
    weight_bytes: int,
    bandwidth: float,
    peak_flops: float,
    kv_dtype: torch.dtype | None = None,
    linear_peak_flops: float | None = None,
    expert_bytes: int = 0,
) -> float:
    """W1's floor: every request resident from the start, so one prefill pass over all
    prompts and then one decode step per output position for the requests still running;
    each step costs max(bytes / bandwidth, flops / peak). The KV bytes are the cache's
    dtype's (kv_dtype, default the model's); the linears' FLOPs run at linear_peak_flops
    (fp8 tensor cores for fp8 weights; default peak_flops), attention's at peak_flops.
    The first output token comes from the prefill pass, the rest from decode steps.
    weight_bytes: a batch-1 step's; a mixture's steps read more of its `expert_bytes` the
    more sequences they hold (decode_step_weight_bytes), a prefill pass all of them."""
    kv_per_token = kv_bytes_per_token(config, kv_dtype)
    linear, per_key = linear_flops_per_token(config), attention_flops_per_key(config)
    linear_peak = linear_peak_flops or peak_flops

    def compute_s(linear_tokens: int, attention_flops: int) -> float:
        return linear * linear_tokens / linear_peak + attention_flops / peak_flops

    prefill_s = compute_s(sum(prompt_lens), sum(per_key * p * (p + 1) // 2 for p in prompt_lens))
    prefill_bytes = decode_step_weight_bytes(weight_bytes, expert_bytes, config, sum(prompt_lens))
    total = max(prefill_bytes / bandwidth, prefill_s)
    for step in range(1, max(output_lens)):
        live = [p + step for p, o in zip(prompt_lens, output_lens) if o > step]
        context = sum(live)
        step_bytes = decode_step_weight_bytes(weight_bytes, expert_bytes, config, len(live)) + kv_per_token * context
        total += max(step_bytes / bandwidth, compute_s(len(live), per_key * context))
    return total
