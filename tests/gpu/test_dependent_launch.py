"""Programmatic dependent launch: a GEMV that starts before the kernel it depends on has
finished must still read that kernel's output. The decode step's chain (RMSNorm -> int4 or
fp8 GEMV -> SiLU-and-mul -> GEMV) is captured in a CUDA graph with PDL and replayed on fresh
inputs; every replay must equal the chain run eagerly without PDL (the same kernels and
summation order, so bit for bit). fp8 runs its word kernel, the one that launches early."""

from __future__ import annotations

import pytest
import torch

from kvserve import dependent_launch
from kvserve.model_executor.layers.triton_ops import add_rms_norm, silu_and_mul
from kvserve.quantization.fp8 import Fp8Linear, quantize_fp8
from kvserve.quantization.int4 import Int4Linear, quantize_int4

HIDDEN, INTERMEDIATE = 4096, 7168


def _layer(kind: str, n: int, k: int, seed: int):
    weight = torch.randn(n, k, generator=torch.Generator("cuda").manual_seed(seed), device="cuda") * 0.05
    if kind == "int4":
        return Int4Linear(*quantize_int4(weight, 128), 128, None)
    q, scale = quantize_fp8(weight)
    return Fp8Linear(q, scale[:, None], None)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_gemvs_launched_early_read_their_inputs(kind, monkeypatch) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    assert dependent_launch.enabled(torch.device("cuda"))
    if kind == "fp8":
        # One fp8 row takes mma.sync (no PDL) where it applies; the word kernel, which
        # launches early, only where it does not: force it here.
        from kvserve.quantization import triton_kernels

        one_row = triton_kernels.FP8_ONE_ROW_WORDS_CONFIG
        monkeypatch.setattr(triton_kernels, "default_config", lambda *args, **kwargs: one_row)
    gate_up = _layer(kind, 2 * INTERMEDIATE, HIDDEN, 0)
    down = _layer(kind, HIDDEN, INTERMEDIATE, 1)
    norm_weight = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return down(silu_and_mul(gate_up(add_rms_norm(x, norm_weight, 1e-5, residual))))

    static_x = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    static_residual = torch.zeros_like(static_x)
    chain(static_x, static_residual)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = chain(static_x, static_residual)
    for seed in range(5):
        generator = torch.Generator("cuda").manual_seed(100 + seed)
        x = torch.randn(1, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
        residual = torch.randn(1, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
        static_x.copy_(x)
        static_residual.copy_(residual)
        graph.replay()
        with monkeypatch.context() as patch:
            patch.setenv("KVSERVE_PDL", "0")
            expected = chain(x, residual.clone())
        assert torch.equal(static_y, expected), f"replay {seed}"
