"""kvserve's CPU multi-LoRA kernel (lora_add_) against a plain fp64 per-token, per-adapter
reference: y_t += B_s (A_s x_t) for token t's slot s, nothing for base-model tokens (-1).
Mixed batches with base rows, adapters of different ranks (zero-padded to the slot rank),
more tokens of one slot than one pass takes, column counts that are no multiple of the
kernel's 16 or 32 lanes, eager and compiled; and a token's result does not depend on the batch."""

from __future__ import annotations

import pytest
import torch


def _slots_and_adapters(num_slots: int, max_rank: int, ranks: list[int], in_features: int,
                        slice_sizes: tuple[int, ...], seed: int):
    """Slot matrices as LoRALinear stores them on CPU (A [slots, slices x rank, in]; per slice
    B^T [slots x rank, out]) holding per-slot adapters of `ranks[s]` (0: an empty slot), and
    those adapters' own A_s [slices, r, in], B_s per slice [out, r] for the reference."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.zeros(num_slots, len(slice_sizes), max_rank, in_features)
    bs = [torch.zeros(num_slots, max_rank, size) for size in slice_sizes]
    adapters = []
    for s, rank in enumerate(ranks):
        own_a = torch.randn(len(slice_sizes), rank, in_features, generator=generator)
        own_b = [torch.randn(size, rank, generator=generator) for size in slice_sizes]
        a[s, :, :rank] = own_a
        for i, b in enumerate(own_b):
            bs[i][s, :rank] = b.t()
        adapters.append((own_a, own_b))
    return (a.view(num_slots, -1, in_features), [b.view(num_slots * max_rank, -1) for b in bs]), adapters


def _reference(y: torch.Tensor, x: torch.Tensor, slots: list[int], adapters, slice_sizes) -> torch.Tensor:
    expected = y.double().clone()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        own_a, own_b = adapters[s]
        offset = 0
        for i, size in enumerate(slice_sizes):
            expected[t, offset:offset + size] += own_b[i].double() @ (own_a[i].double() @ x[t].double())
            offset += size
    return expected


@pytest.mark.parametrize("in_features,slice_sizes,max_rank", [(40, (48, 16, 16), 8), (37, (21,), 5), (64, (35, 70), 8)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixed_batch_matches_per_adapter_reference(lora_add, in_features: int, slice_sizes: tuple[int, ...],
                                                   max_rank: int, compiled: bool) -> None:
    num_slots = 4
    ranks = [max_rank, 3, 0, 5]  # slot 2 empty: its tokens get a zero delta
    (a, bs), adapters = _slots_and_adapters(num_slots, max_rank, ranks, in_features, slice_sizes, seed=1)
    # Slot 0 has 6 tokens (two passes of the kernel), base rows interleaved.
    slots = [0, -1, 1, 0, 3, 0, -1, 2, 0, 1, 0, 3, 0, -1]
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(len(slots), in_features, generator=generator)
    y = torch.randn(len(slots), sum(slice_sizes), generator=generator)
    token_slots = torch.full((len(slots) + 5,), 1, dtype=torch.int32)  # entries past T are not read
    token_slots[: len(slots)] = torch.tensor(slots, dtype=torch.int32)
    expected = _reference(y, x, slots, adapters, slice_sizes)

    def add(y: torch.Tensor) -> torch.Tensor:
        torch.ops.kvserve_cpu.lora_add_(y, x, token_slots, a, bs)
        return y

    out = (torch.compile(add, fullgraph=True) if compiled else add)(y.clone())
    assert torch.allclose(out.double(), expected, atol=1e-4, rtol=1e-5)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base_rows], y[base_rows])  # base-model rows untouched


def test_a_token_does_not_depend_on_the_batch(lora_add) -> None:
    num_slots, max_rank, in_features, slice_sizes = 3, 16, 96, (64, 32)
    (a, bs), _ = _slots_and_adapters(num_slots, max_rank, [16, 16, 7], in_features, slice_sizes, seed=3)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(11, in_features, generator=generator)
    y = torch.randn(11, sum(slice_sizes), generator=generator)
    slots = torch.tensor([2, 0, 2, 2, 1, 2, 2, -1, 0, 2, 2], dtype=torch.int32)
    batched = y.clone()
    lora_add(batched, x, slots, a, bs)
    for t in range(len(slots)):
        alone = y[t:t + 1].clone()
        lora_add(alone, x[t:t + 1], slots[t:t + 1], a, bs)
        assert torch.equal(alone[0], batched[t])


def test_refuses_bad_shapes(lora_add) -> None:
    (a, bs), _ = _slots_and_adapters(2, 4, [4, 4], 8, (6,), seed=5)
    x, y = torch.randn(3, 8), torch.zeros(3, 6)
    with pytest.raises(RuntimeError, match="slot 2 of 2"):
        lora_add(y, x, torch.tensor([0, 2, -1], dtype=torch.int32), a, bs)
    with pytest.raises(RuntimeError, match="columns"):
        lora_add(torch.zeros(3, 7), x, torch.tensor([0, 1, -1], dtype=torch.int32), a, bs)
