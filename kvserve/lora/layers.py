"""A linear (dense or quantized) plus the LoRA deltas of every adapter slot, applied to each
token by its slot: one batch mixes adapters and the base model.

Each token carries its slot index (-1: the base model) in `token_slots`, a buffer updated in
place every step, so the compiled CPU decode graph and CUDA graphs take it as an input and
never branch on which adapters run. On CUDA, Triton kernels (ops/lora.py) read it on the
device. On CPU, kvserve's `lora_add_` kernel (ops/cpu/csrc/lora.cpp) groups the step's tokens
by slot and runs each token through its own slot's A and B only, each slot's matrices read
once for all of its tokens; where the kernel cannot be built, torch computes every token
against every slot and masks the result (slots x the work)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.ops import cpu as cpu_kernels
from kvserve.ops.lora import SlotGroups, group_by_slot, lora_expand, lora_shrink, sgmv_expand, sgmv_shrink

# From this many tokens in a forward pass, the CUDA kernels take the tokens grouped by slot
# (SGMV); below it one program per token (BGMV), which needs no grouping.
SGMV_MIN_TOKENS = 64


class StepSlotGroups:
    """A forward pass's tokens grouped by slot (ops.lora.group_by_slot), computed on the
    device by the first LoRA layer that needs them and shared by the others. Forgotten at
    the start of each forward of the model (a pre-hook), so a captured CUDA graph records
    the grouping of its own slots and an eager step never reuses another's."""

    def __init__(self, model: nn.Module, token_slots: torch.Tensor, num_slots: int) -> None:
        self.token_slots, self.num_slots = token_slots, num_slots
        self._groups: dict[int, SlotGroups] = {}
        model.register_forward_pre_hook(lambda *_: self._groups.clear())

    def get(self, num_tokens: int) -> SlotGroups:
        groups = self._groups.get(num_tokens)
        if groups is None:
            groups = self._groups[num_tokens] = group_by_slot(self.token_slots, num_tokens, self.num_slots)
        return groups


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, slice_sizes: tuple[int, ...], max_loras: int,
                 max_rank: int, token_slots: torch.Tensor, dtype: torch.dtype,
                 slot_groups: StepSlotGroups | None = None) -> None:
        """`token_slots`, int32 [max tokens] shared by every LoRA layer of the model: the slot
        each token of the step runs with, -1 for the base model. `dtype`: the run dtype, the
        matrices' (QLoRA-style on quantized bases). `slot_groups` (CUDA): the step's tokens
        grouped by slot, for many-token forwards (None: always per token)."""
        super().__init__()
        self.slot_groups = slot_groups
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
        if self.slot_groups is not None and x.shape[0] >= SGMV_MIN_TOKENS:
            groups = self.slot_groups.get(x.shape[0])
            h = sgmv_shrink(x.contiguous(), self.lora_a, groups)
            offset = 0
            for index, size in enumerate(self.slice_sizes):
                sgmv_expand(h, index * self.max_rank, self.lora_b(index), self.max_rank, self.max_loras, groups, y,
                            offset)
                offset += size
            return y
        slots = self.token_slots
        h = lora_shrink(x.contiguous(), self.lora_a, slots)
        offset = 0
        for index, size in enumerate(self.slice_sizes):
            lora_expand(h, index * self.max_rank, self.lora_b(index), self.max_rank, slots, y, offset)
            offset += size
        return y

