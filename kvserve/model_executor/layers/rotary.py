"""Rotary position embedding (non-interleaved "rotate_half" convention), with the
Hugging Face default, linear and llama3 frequency schemes."""

from __future__ import annotations

import math
from typing import Any

import torch

# "freq_factors": per-frequency divisors stored in a GGUF file (llama.cpp's rope_freqs).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32)
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding:
    """Holds inverse frequencies as a plain tensor (not a buffer) so that models built on
    the meta device and materialized later keep valid values."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim / 2] cos and sin in fp32, computed once per forward for all layers."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL): each position is (temporal, height, width), and the
    frequencies are split into three sections, each rotated by its own coordinate. Text
    tokens have three equal coordinates, which makes it plain RoPE."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...]) -> None:
        super().__init__(head_dim, theta, None)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
        # Which coordinate rotates each frequency.
        self.section_of_freq = torch.tensor(
            [index for index, size in enumerate(mrope_section) for _ in range(size)], device="cpu")

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] (or [T]: every coordinate equal); cos and sin [T, head_dim / 2]."""
        if positions.dim() == 1:
            return super().cos_sin(positions)
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self.section_of_freq = self.section_of_freq.to(positions.device)
        # [T, head_dim / 2], contiguous: the CUDA rotary kernel takes rows of cos and sin.
        chosen = positions.float()[self.section_of_freq].T.contiguous()
        freqs = chosen * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim / 2]. On CUDA x is rotated in place
    by one Triton kernel; elsewhere a new tensor is returned."""
    if x.is_cuda:
        from kvserve.ops.elementwise import rotary_

        return rotary_(x, cos, sin)
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
