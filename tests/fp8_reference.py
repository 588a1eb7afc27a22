"""The per-token e4m3 quantization of activations, as torch computes it on the CPU: the
reference of every kernel that quantizes rows (fp8_activation, the fused Fp8Rows kernels)."""

from __future__ import annotations

import torch


def per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Correctly rounded fp32 divisions (through fp64, on the CPU: CUDA torch divides by a
    scalar as a multiplication by its rounded reciprocal), then e4m3 to nearest even."""
    x = x.cpu().double()
    scale = (x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448).float()
    q = (x / scale.double()).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def fp8_mismatches(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> int:
    """How many of the quantized values and scales differ from per_token_reference(rows)."""
    ref_q, ref_scale = per_token_reference(rows)
    return int((values.cpu().view(torch.uint8) != ref_q.view(torch.uint8)).sum()
               + (scales.cpu() != ref_scale).sum())
