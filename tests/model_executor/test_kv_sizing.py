"""The KV cache's sizes, by hand."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_executor.dummy import dummy_model_config
from kvserve.model_executor.kv_sizing import blocks_in_budget, kv_bytes_per_token, kv_cache_bytes_per_block


def test_sizes_of_smollm2():
    config = dummy_model_config("smollm2-135m")  # fp32: 4 bytes a value
    assert kv_bytes_per_token(config) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(config, torch.float8_e4m3fn) == 46_080 // 4
    assert kv_cache_bytes_per_block(config, 16) == 16 * 46_080 == 737_280
    assert blocks_in_budget(64 * 2**20, 737_280, 16) == 91  # 67,108,864 / 737,280 = 91.02


def test_a_budget_without_one_block_is_refused():
    with pytest.raises(ValueError, match=r"does not hold a single block of 16 tokens \(0.70 MiB\)"):
        blocks_in_budget(737_279, 737_280, 16)
