"""The split-K W8A8 kernel (fp8_w8a8) against the fp64 product of the same fp8 operands and
scales: under Triton's interpreter on odd shapes in CI (one subprocess), and on CUDA (marked
gpu) on llama3-8b-sized linears at W1's decode rows, inside a captured CUDA graph too."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.ops.quant.fp8_activation import quantize_per_token
from kvserve.ops.quant.fp8_w8a8 import DECODE_CONFIG, fp8_w8a8_matmul, w8a8_config
from kvserve.ops.quant.weight_only import LaunchConfig
from kvserve.quantization.fp8 import Fp8Linear, quantize_fp8
from tests.fp8_reference import per_token_reference
from tests.triton_interpreter import run_interpreted

# (rows, out features, in features, config): rows and columns that are not whole tiles,
# one row, several row tiles, K in 1-3 splits (a remainder split too), 256-wide K tiles.
SMALL_CASES = (
    (37, 80, 384, LaunchConfig(32, 32, 128, split_k=1)),
    (37, 80, 384, LaunchConfig(32, 32, 128, split_k=2)),
    (70, 48, 640, LaunchConfig(32, 16, 128, split_k=3)),
    (1, 24, 256, LaunchConfig(16, 16, 128, split_k=2)),
    (19, 40, 512, LaunchConfig(16, 32, 256, split_k=2)),
)

# Relative to the output's largest magnitude: bf16 rounding of the output (2^-9) with room
# for fp32 accumulation order.
BF16_TOLERANCE = 4e-3


def _operands(m: int, n: int, k: int, seed: int, device: str = "cpu"):
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=generator, device=device)
    w = torch.randn(n, k, generator=generator, device=device) * 0.05
    w_q, w_scale = quantize_fp8(w)
    # The per-token quantization as torch writes it (the kernel's test checks the Triton one).
    x_scale = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    x_q = (x / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    reference = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t()
    return x_q, x_scale, w_q, w_scale, reference


def _error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.double() - reference).abs().max() / reference.abs().max()).item()


def run_small_cases() -> None:
    """Interpreter subprocess: each case's error, fp32 and bf16 outputs, as one JSON line."""
    errors = {}
    for i, (m, n, k, config) in enumerate(SMALL_CASES):
        x_q, x_scale, w_q, w_scale, reference = _operands(m, n, k, seed=i)
        for dtype in (torch.float32, torch.bfloat16):
            for swap_ab in (False, True):
                y = fp8_w8a8_matmul(x_q, x_scale, w_q, w_scale, config, out_dtype=dtype, swap_ab=swap_ab)
                errors[f"{i}-{dtype}-{swap_ab}"] = _error(y, reference) if y.shape == reference.shape else 1.0
    # The layer's own path: x [2, 3, K] in bf16, quantized per token by the Triton kernel.
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    w_q, w_scale = quantize_fp8(torch.randn(40, 256, generator=torch.Generator().manual_seed(8)) * 0.05)
    x_q, x_scale = per_token_reference(x.reshape(6, 256))
    reference = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t()
    y = Fp8Linear(w_q, w_scale[:, None], None)._w8a8(x, LaunchConfig(16, 16, 128, split_k=2))
    errors["layer"] = _error(y.reshape(6, 40), reference) if y.shape == (2, 3, 40) else 1.0
    print(json.dumps(errors))


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    return json.loads(run_interpreted("tests.ops.quant.test_fp8_w8a8", "run_small_cases"))


@pytest.mark.parametrize("swap_ab", (False, True), ids=("x-w", "w-x"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", range(len(SMALL_CASES)), ids=lambda i: "{}x{}x{}".format(*SMALL_CASES[i][:3]))
def test_interpreted_matches_fp64_product(case, dtype, swap_ab, interpreted_errors) -> None:
    # fp32 output: only the fp32 accumulation order differs from fp64.
    error = interpreted_errors[f"{case}-{dtype}-{swap_ab}"]
    assert error < (1e-5 if dtype == torch.float32 else BF16_TOLERANCE)


def test_interpreted_layer_quantizes_and_multiplies_its_input(interpreted_errors) -> None:
    assert interpreted_errors["layer"] < BF16_TOLERANCE


def test_rejects_k_that_is_not_whole_tiles() -> None:
    x_q, x_scale, w_q, w_scale, _ = _operands(4, 8, 200, seed=0)
    with pytest.raises(ValueError, match="K=200"):
        fp8_w8a8_matmul(x_q, x_scale, w_q, w_scale, LaunchConfig(16, 16, 128))


def test_routing_takes_decode_batches_where_the_sweep_found_it_faster() -> None:
    """2-64 rows on every llama3-8b linear; 65-128 on o_proj (N 4096) and down (K 14336),
    not on qkv and gate/up, which cuBLAS runs as fast; never past 128 rows or at one (the
    weight-only kernel with the norms fused in), nor K in part-tiles. Up to 16 rows in one
    16-row tile."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    taken = {name: [rows for rows in (1, 2, 16, 17, 64, 65, 128, 129) if w8a8_config(rows, n, k)]
             for name, (n, k) in shapes.items()}
    assert taken == {"qkv": [2, 16, 17, 64], "o": [2, 16, 17, 64, 65, 128], "gate_up": [2, 16, 17, 64],
                     "down": [2, 16, 17, 64, 65, 128]}
    assert w8a8_config(32, 4096, 4096 + 128) is None
    assert [w8a8_config(rows, 4096, 4096).block_m for rows in (2, 16, 17, 128)] == [16, 16, 64, 64]


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Hopper's fp8 tensor cores accumulate without promoting every product to fp32 (as
# `_scaled_mm`'s use_fast_accum, which the prefill path uses): against the fp64 product,
# 3-7e-3 of the output's largest magnitude on llama3-8b's shapes, as large as cuBLAS's
# (BENCHMARKS.md, "Kernel level (GPU)"). A lost split or a wrong scale is off by O(1).
GPU_TOLERANCE = 1.5e-2

GPU_CONFIGS = (
    DECODE_CONFIG,
    LaunchConfig(128, 64, 128, num_warps=8, num_stages=4, waves=2),
    LaunchConfig(64, 128, 128, num_warps=4, num_stages=3, split_k=5),
    LaunchConfig(16, 128, 256, num_warps=4, num_stages=3, waves=2),  # swap_ab
)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}")
@pytest.mark.parametrize("rows", (3, 16, 17, 65, 100, 128, 200))
@pytest.mark.parametrize("shape", ((6144, 4096), (4096, 14336), (28672, 4096)), ids=str)
def test_gpu_matches_fp64_product(rows, shape, config) -> None:
    n, k = shape
    x_q, x_scale, w_q, w_scale, reference = _operands(rows, n, k, seed=rows, device="cuda")
    y = fp8_w8a8_matmul(x_q, x_scale, w_q, w_scale, config)
    assert _error(y, reference) < GPU_TOLERANCE
    # The split-K counters are left re-armed: a second call gives the same bits.
    assert torch.equal(fp8_w8a8_matmul(x_q, x_scale, w_q, w_scale, config), y)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", (2, 16, 17, 48, 100, 128))
def test_gpu_fp8_layer_runs_decode_batches_on_the_kernel(rows, monkeypatch) -> None:
    """Fp8Linear at 2-128 rows takes fp8_w8a8 (for llama3-8b's down at every such row count)
    and matches the fp64 product of its own quantized x and weight."""
    from kvserve.ops.quant import fp8_w8a8

    calls = []
    monkeypatch.setattr(fp8_w8a8, "fp8_w8a8_kernel", _counting(fp8_w8a8.fp8_w8a8_kernel, calls))
    q, scale = quantize_fp8(torch.randn(4096, 14336, device="cuda") * 0.05)
    layer = Fp8Linear(q, scale[:, None], None)
    x = torch.randn(rows, 14336, device="cuda", dtype=torch.bfloat16)
    y = layer.apply(x)
    x_q, x_scale = quantize_per_token(x)
    reference = (x_q.double() * x_scale.double()) @ layer.dequantize(torch.float64).t()
    assert calls and _error(y, reference) < GPU_TOLERANCE


class _counting:
    """A kernel whose launches are recorded."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.gpu
@requires_cuda
def test_gpu_replays_in_a_cuda_graph() -> None:
    x = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_fp8(torch.randn(4096, 4096, device="cuda") * 0.05)

    def step() -> torch.Tensor:
        return fp8_w8a8_matmul(*quantize_per_token(x), w_q, w_scale, DECODE_CONFIG)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    x_q, x_scale = quantize_per_token(x)
    reference = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t()
    assert _error(y, reference) < GPU_TOLERANCE


def test_fp8_rows_go_only_to_layers_that_run_the_kernel() -> None:
    """takes_fp8_rows is off on the CPU (no producer quantizes there) and for non-linears;
    Fp8Rows that reach a layer which declines them are dequantized, not misread."""
    from kvserve.ops.quant.fp8_rows import Fp8Rows
    from kvserve.quantization.base import takes_fp8_rows

    q, scale = quantize_fp8(torch.randn(48, 256) * 0.05)
    layer = Fp8Linear(q, scale[:, None], None)
    assert not layer.takes_fp8_rows(8, torch.bfloat16)
    assert not takes_fp8_rows(None, 8, torch.bfloat16) and not takes_fp8_rows(torch.nn.ReLU(), 8, torch.bfloat16)
    x_q, x_scale, _, _, _ = _operands(5, 48, 256, seed=3)
    rows = Fp8Rows(x_q, x_scale, torch.float32)
    reference = (x_q.double() * x_scale.double()) @ layer.dequantize(torch.float64).t()
    assert _error(layer.apply(rows), reference) < 1e-5
