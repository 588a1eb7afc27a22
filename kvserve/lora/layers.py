"""A linear (dense or quantized) plus the LoRA deltas of every adapter slot, applied to each
token by its slot: one batch mixes adapters and the base model.

Each token carries its slot index (-1: the base model) in `token_slots`, a buffer updated in
place every step, so the compiled CPU decode graph and CUDA graphs take it as an input and
never branch on which adapters run. On CUDA, Triton kernels (ops/lora.py) read it on the
device: per token for a few tokens (decode), grouped by slot on the device for many (prefill:
each slot's matrices read once a tile of its tokens, on the tensor cores; from
KVSERVE_LORA_SGMV_MIN_TOKENS tokens, default 32), the grouping made once a forward pass and
shared by every layer (SlotGroupsCache). On CPU, kvserve's `lora_add_` kernel
(ops/cpu/csrc/lora.cpp) groups the step's tokens by slot and runs each token through its own
slot's A and B only, each slot's matrices read once for all of its tokens; where the kernel
cannot be built, torch computes every token against every slot and masks the result (slots x
the work)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve import envs
from kvserve.ops import cpu as cpu_kernels
from kvserve.ops.lora import (MAX_SLICES, SlotGroups, align_by_slot, lora_expand_slices, lora_shrink, sgmv_expand,
                              sgmv_shrink)


class SlotGroupsCache:
    """The step's tokens grouped by slot, made by the first layer of a forward pass that
    needs them and reused by the others. Only between `begin()` and `end()` (hooks around the
    model's forward that LoRASlots registers): a layer called on its own groups its tokens itself, as
    token_slots may have changed since. Inside a CUDA graph capture the grouping is captured
    once, before the first LoRA layer, and replays with the slots of each replay."""

    def __init__(self) -> None:
        self.active = False
        self.groups: dict[tuple[int, int], SlotGroups] = {}

    def begin(self) -> None:
        self.groups.clear()
        self.active = True

    def end(self) -> None:
        self.groups.clear()
        self.active = False

    def get(self, token_slots: torch.Tensor, num_tokens: int, num_slots: int) -> SlotGroups:
        if not self.active:
            return align_by_slot(token_slots, num_tokens, num_slots)
        key = (num_tokens, num_slots)
        groups = self.groups.get(key)
        if groups is None:
            groups = self.groups[key] = align_by_slot(token_slots, num_tokens, num_slots)
        return groups


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, slice_sizes: tuple[int, ...], max_loras: int,
                 max_rank: int, token_slots: torch.Tensor, dtype: torch.dtype,
                 groups_cache: SlotGroupsCache | None = None) -> None:
        """`token_slots`, int32 [max tokens] shared by every LoRA layer of the model: the slot
        each token of the step runs with, -1 for the base model. `dtype`: the run dtype, the
        matrices' (QLoRA-style on quantized bases). `groups_cache`: shared by the model's
        layers, so that a forward pass groups its tokens by slot once."""
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.out_features = sum(slice_sizes)
        self.slice_sizes = slice_sizes
        self.max_loras, self.max_rank = max_loras, max_rank
        device = token_slots.device
        # A: rows ordered (slot, slice, rank). Each B: columns ordered (slot, rank), stored
        # transposed on CPU ([slots x rank, out]: the CPU kernel reads a slot's rank rows
        # along the output columns).
        self.transposed = device.type == "cpu"
        # Decided once: checking per call cost ~6 us of a ~60 us layer (120 layers a step).
        self.cpu_kernel = self.transposed and dtype == torch.float32 and cpu_kernels.available()
        self.register_buffer("lora_a", torch.zeros(max_loras, len(slice_sizes) * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        for index, size in enumerate(slice_sizes):
            shape = (max_loras * max_rank, size) if self.transposed else (size, max_loras * max_rank)
            self.register_buffer(f"lora_b_{index}", torch.zeros(*shape, dtype=dtype, device=device),
                                 persistent=False)
        self.b_names = tuple(f"lora_b_{index}" for index in range(len(slice_sizes)))
        self.groups_cache = groups_cache if groups_cache is not None else SlotGroupsCache()
        # On CUDA, steps of this many tokens or more take the grouped kernels.
        self.sgmv_min_tokens = envs.KVSERVE_LORA_SGMV_MIN_TOKENS
        self.register_buffer("token_slots", token_slots, persistent=False)
        self.register_buffer("slot_indices", torch.arange(max_loras, dtype=torch.int32, device=device),
                             persistent=False)

    def lora_b(self, index: int) -> torch.Tensor:
        return getattr(self, f"lora_b_{index}")

    def set_slot(self, slot: int, slices: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter into `slot`: (slice index, A [r, in], B [out_slice, r] scaled) per
        slice it targets; the other slices, and ranks past r, are zero."""
        a = self.lora_a.view(self.max_loras, len(self.slice_sizes), self.max_rank, self.in_features)
        # Each B viewed as [out, slot, rank], however it is stored.
        b = [(self.lora_b(index).t() if self.transposed else self.lora_b(index)).unflatten(
            1, (self.max_loras, self.max_rank)) for index in range(len(self.slice_sizes))]
        a[slot].zero_()
        for slice_b in b:
            slice_b[:, slot].zero_()
        for index, lora_a, lora_b in slices:
            rank = lora_a.shape[0]
            a[slot, index, :rank].copy_(lora_a)
            b[index][:, slot, :rank].copy_(lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if x.is_cuda:
            return self._forward_kernels(x, y)
        y = y.reshape(x.shape[0], self.out_features)
        if self.cpu_kernel:
            y = y.contiguous()
            buffers = self._buffers  # nn.Module's attribute lookup costs ~1 us a buffer, 120 layers a step
            torch.ops.kvserve_cpu.lora_add_(y, x.contiguous(), buffers["token_slots"], buffers["lora_a"],
                                            [buffers[name] for name in self.b_names])
            return y
        return self._forward_masked(x, y)

    def _forward_masked(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """CPU without kvserve's kernel: every token against every slot (x @ A_all^T), each
        token's row masked to its own slot, then per slice @ B^T accumulated into y."""
        num_tokens, num_slices = x.shape[0], len(self.slice_sizes)
        mask = (self.token_slots[:num_tokens, None] == self.slot_indices).to(x.dtype)
        shrunk = torch.mm(x, self.lora_a.view(-1, self.in_features).t())
        shrunk = shrunk.view(num_tokens, self.max_loras, num_slices, self.max_rank)
        shrunk = shrunk * mask[:, :, None, None]
        offset = 0
        for index, size in enumerate(self.slice_sizes):
            y[:, offset:offset + size].addmm_(shrunk[:, :, index].reshape(num_tokens, -1), self.lora_b(index))
            offset += size
        return y

    def _forward_kernels(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One shrink of every slice, then one expand a group of up to three slices (a fused
        projection's in one launch)."""
        slots = self.token_slots
        num_tokens = x.shape[0]
        grouped = num_tokens >= self.sgmv_min_tokens  # shape-static: the same kernels on every graph replay
        if grouped:
            groups = self.groups_cache.get(slots, num_tokens, self.max_loras)
            h = sgmv_shrink(x.contiguous(), self.lora_a, groups)
        else:
            h = lora_shrink(x.contiguous(), self.lora_a, slots)
        buffers = self._buffers
        offset = 0
        for first in range(0, len(self.slice_sizes), MAX_SLICES):
            bs = [buffers[name] for name in self.b_names[first:first + MAX_SLICES]]
            if grouped:
                sgmv_expand(h, bs, self.max_rank, groups, y, first * self.max_rank, offset)
            else:
                lora_expand_slices(h, bs, self.max_rank, slots, y, first * self.max_rank, offset)
            offset += sum(self.slice_sizes[first:first + MAX_SLICES])
        return y
