"""How many bytes the paged KV cache takes and how many blocks a budget holds: the one
place both the model runner and the capacity planner size the cache."""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig

# The KV budget on a CPU when none is given: the cache is mapped lazily, so this is a cap on
# what it may grow to, not memory taken at start.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def kv_bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype | None = None) -> int:
    """K and V of every layer for one token (kv_dtype: the cache's, default the model's)."""
    element_size = torch.empty((), dtype=kv_dtype or config.dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype | None = None
) -> int:
    return block_size * kv_bytes_per_token(config, kv_cache_dtype)


def blocks_in_budget(budget: int, bytes_per_block: int, block_size: int) -> int:
    """Whole blocks in `budget` bytes; raises when not even one fits."""
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"The KV cache budget ({budget / 2**20:.1f} MiB) does not hold a single block of "
            f"{block_size} tokens ({bytes_per_block / 2**20:.2f} MiB); raise "
            "--kv-cache-memory / --gpu-memory-utilization or lower --block-size."
        )
    return num_blocks
