"""A linear (dense or quantized) plus the LoRA deltas of every adapter slot, applied to each
token by its slot: one batch mixes adapters and the base model.

On CUDA, Triton kernels (ops/lora.py) read each token's slot index on the device and apply
that slot's matrices only. On CPU the deltas are computed for all slots at once, each
token's row masked to its own slot:
x @ A_all^T ([T, slices x slots x rank]), times the token's one-hot slot mask, then per slice
@ B_all^T ([slots x rank, out]), accumulated into the base output. A step reads every slot's A and B once, however many tokens
it has (gathering each token's A and B would read them once per token: 16 decode rows of
SmolLM2 would move ~300 MB of adapter weights against the base's 425), with no shape that
depends on which adapters run, so the compiled CPU decode graph and CUDA graphs take the
slot mask as an input (a buffer updated in place) and never branch on it. Base-model tokens
have an all-zero mask row."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.ops.lora import lora_expand, lora_shrink


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, slice_sizes: tuple[int, ...], max_loras: int,
                 max_rank: int, token_slots: torch.Tensor, dtype: torch.dtype) -> None:
        """`token_slots`, shared by every LoRA layer of the model, says which slot each token
        of the step runs with: on CUDA int32 [max tokens], the slot or -1 (the base model);
        on CPU [max tokens, max_loras] in the run dtype, row t token t's one-hot slot (zeros:
        the base model). `dtype`: the run dtype, the matrices' (QLoRA-style on quantized bases)."""
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.out_features = sum(slice_sizes)
        self.slice_sizes = slice_sizes
        self.max_loras, self.max_rank = max_loras, max_rank
        device = token_slots.device
        # Rows of A ordered (slot, slice, rank) for the CUDA kernels; columns of each B ordered
        # (slot, rank). On CPU both are stored transposed (A^T [in, rows], B^T [slots x rank,
        # out]): MKL's GEMM on a plain [K, N] right-hand side was 1.5-2x faster than on a
        # transposed one at 16 rows (SmolLM2's shapes, one core of a 2-core Xeon); and A's rows
        # are ordered (slice, slot, rank), so each slice's shrunk columns are one contiguous run.
        self.transposed = device.type == "cpu"
        rows = max_loras * len(slice_sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(*self._stored((rows, in_features)), dtype=dtype, device=device),
                             persistent=False)
        for index, size in enumerate(slice_sizes):
            self.register_buffer(f"lora_b_{index}", torch.zeros(*self._stored((size, max_loras * max_rank)),
                                                                 dtype=dtype, device=device), persistent=False)
        self.register_buffer("token_slots", token_slots, persistent=False)

    def _stored(self, shape: tuple[int, int]) -> tuple[int, int]:
        return shape[::-1] if self.transposed else shape

    def _as_written(self, buffer: torch.Tensor) -> torch.Tensor:
        """A buffer as [rows, in] (A) or [out, slots x rank] (B), whichever way it is stored."""
        return buffer.t() if self.transposed else buffer

    def lora_b(self, index: int) -> torch.Tensor:
        return getattr(self, f"lora_b_{index}")

    def set_slot(self, slot: int, slices: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter into `slot`: (slice index, A [r, in], B [out_slice, r] scaled) per
        slice it targets; the other slices, and ranks past r, are zero."""
        num_slices = len(self.slice_sizes)
        a = self._as_written(self.lora_a)  # viewed as [slot, slice, rank, in] either way
        if self.transposed:
            a = a.unflatten(0, (num_slices, self.max_loras, self.max_rank)).transpose(0, 1)
        else:
            a = a.unflatten(0, (self.max_loras, num_slices, self.max_rank))
        b = [self._as_written(self.lora_b(index)).unflatten(1, (self.max_loras, self.max_rank))
             for index in range(num_slices)]
        a[slot].zero_()
        for index in range(num_slices):
            b[index][:, slot].zero_()
        for index, lora_a, lora_b in slices:
            rank = lora_a.shape[0]
            a[slot, index, :rank].copy_(lora_a)
            b[index][:, slot, :rank].copy_(lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if x.is_cuda:
            return self._forward_kernels(x, y)
        num_tokens, num_slices = x.shape[0], len(self.slice_sizes)
        # MKL's sgemm, not kvserve's few-row kernel (layers/linear.py): these weights are narrow
        # (rank x slots rows or columns), where it was 1.3-2x faster at 16 rows on one core of
        # a 2-core EPYC (SmolLM2's shapes, 4 slots of rank 16). The expand accumulates into the
        # base output's columns (addmm with beta 1) rather than concatenating the slices' deltas
        # and adding them: two fewer ops and copies a layer. bf16 or oneDNN-packed slots
        # measured no faster than fp32 [K, N] operands at these shapes (2-core AMX Xeon).
        shrunk = torch.mm(x, self.lora_a).view(num_tokens, num_slices, self.max_loras, self.max_rank)
        shrunk = (shrunk * self.token_slots[:num_tokens, None, :, None]).view(
            num_tokens, num_slices, self.max_loras * self.max_rank)
        y = y.reshape(num_tokens, self.out_features)
        offset = 0
        for index, size in enumerate(self.slice_sizes):
            y[:, offset:offset + size].addmm_(shrunk[:, index], self.lora_b(index))
            offset += size
        return y

    def _forward_kernels(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.token_slots
        num_slices = len(self.slice_sizes)
        lora_a = self.lora_a.view(self.max_loras, num_slices * self.max_rank, self.in_features)
        h = lora_shrink(x.contiguous(), lora_a, slots)
        offset = 0
        for index, size in enumerate(self.slice_sizes):
            lora_expand(h, index * self.max_rank, self.lora_b(index), self.max_rank, slots, y, offset)
            offset += size
        return y

