"""LoRALinear against a per-token fp32 reference: y_t = base(x_t) + B_s (A_s x_t) for token t's
slot s, base only for tokens without one; and the adapter id in the prefix-cache hash."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.lora.layers import LoRALinear
from kvserve.model_executor.layers.linear import Linear
from kvserve.ops import cpu as cpu_kernels


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "masked"])
def test_mixed_slots_match_per_token_reference(cpu_kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_kernel:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    elif not cpu_kernels.available():
        pytest.skip("kvserve's CPU kernels could not be built here")
    torch.manual_seed(0)
    in_features, slice_sizes, max_loras, max_rank = 24, (16, 8, 8), 3, 5
    base = Linear(in_features, sum(slice_sizes), bias=True)
    token_slots = torch.full((32,), -1, dtype=torch.int32)
    layer = LoRALinear(base, in_features, slice_sizes, max_loras, max_rank, token_slots, torch.float32)
    # Slot 0: rank 5 on slices 0 and 2; slot 2: rank 2 on slice 1; slot 1 stays empty.
    adapters = {
        0: [(0, torch.randn(5, in_features), torch.randn(16, 5)), (2, torch.randn(5, in_features), torch.randn(8, 5))],
        2: [(1, torch.randn(2, in_features), torch.randn(8, 2))],
    }
    layer.set_slot(1, [(0, torch.randn(5, in_features), torch.randn(16, 5))])  # overwritten next
    layer.set_slot(1, [])
    for slot, slices in adapters.items():
        layer.set_slot(slot, slices)
    slots = [0, -1, 2, 2, 1, 0, -1, 0, 2, 0, 1]
    x = torch.randn(len(slots), in_features)
    token_slots[: len(slots)] = torch.tensor(slots, dtype=torch.int32)
    token_slots[len(slots):] = 2  # entries past the step's tokens are never read

    expected = torch.nn.functional.linear(x, base.weight, base.bias).double()
    offsets = [0, 16, 24, 32]
    for t, slot in enumerate(slots):
        for index, lora_a, lora_b in adapters.get(slot, []):
            delta = lora_b.double() @ (lora_a.double() @ x[t].double())
            expected[t, offsets[index] : offsets[index + 1]] += delta
    assert torch.allclose(layer(x).double(), expected, atol=1e-4, rtol=1e-5)


def test_prefix_cache_hash_includes_the_adapter() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 113))
    for seq_id, lora_id in (("base", 0), ("one", 1)):
        manager.allocate_slots(seq_id, tokens, 0, len(tokens))
        manager.cache_full_blocks(seq_id, tokens, len(tokens), lora_int_id=lora_id)
    assert len(manager.find_cached_prefix(tokens, lora_int_id=0)) == 3
    assert len(manager.find_cached_prefix(tokens, lora_int_id=1)) == 3
    assert manager.find_cached_prefix(tokens, lora_int_id=2) == []
    base_blocks = {b.block_id for b in manager.find_cached_prefix(tokens, lora_int_id=0)}
    assert base_blocks.isdisjoint(b.block_id for b in manager.find_cached_prefix(tokens, lora_int_id=1))
