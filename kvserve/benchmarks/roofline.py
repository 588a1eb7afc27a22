"""The floor of a decode step: the bytes it must move over the memory bandwidth measured here."""

from __future__ import annotations

import time

import torch

from kvserve.config import ModelConfig


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


def weight_bytes_per_step(model: torch.nn.Module, config: ModelConfig) -> int:
    """Every parameter and buffer is read once per step, except an untied input embedding,
    of which a step only gathers one row per token. Counts quantized weights as stored."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not config.tie_word_embeddings:
        embedding = model.model.embed_tokens.weight
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype | None = None) -> int:
    element_size = torch.empty((), dtype=kv_dtype or config.dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size


def decode_step_floor_s(weight_bytes: int, kv_bytes_per_tok: int, context_tokens: int, bandwidth: float) -> float:
    """Seconds a decode step needs at least: weights once plus the live KV of every sequence."""
    return (weight_bytes + kv_bytes_per_tok * context_tokens) / bandwidth
