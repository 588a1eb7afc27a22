"""The Triton weight-only matmul (W8A16, W4A16, fp8 weights) against an fp64 product of
the layers' own dequantized weights.

Without a GPU the kernel runs under Triton's interpreter on small odd shapes, all in one
subprocess (tests/triton_interpreter.py); on CUDA the layers run it on real shapes
(marked gpu), through their apply() and inside a captured CUDA graph."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from kvserve.quantization import base
from kvserve.quantization.fp8 import Fp8Linear, quantize_fp8
from kvserve.quantization.int4 import Int4Linear, quantize_int4
from kvserve.quantization.int8 import GroupInt8Linear, Int8Linear
from kvserve.quantization.triton_kernels import LaunchConfig, weight_only_matmul
from tests.triton_interpreter import run_interpreted

# Worst relative error ||y - ref|| / ||ref|| per row against fp64 on the same weights.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _float_linear(n: int, k: int, seed: int, device: str = "cpu") -> nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=generator) * 0.05)
    return layer.to(device)


def make_layer(kind: str, n: int, k: int, seed: int = 0, device: str = "cpu"):
    """A layer of each stored form the kernel reads: per-channel int8, group int8 with
    offsets (GGUF/GPTQ grids), int4 nibble pairs with float minimums, fp8 per channel and
    fp8 in 32-wide groups (block-wise checkpoints)."""
    layer = _float_linear(n, k, seed, device)
    weight = layer.weight.detach()
    if kind == "int8":
        return Int8Linear(layer)
    if kind == "group_int8":
        q, scale, minimum = quantize_int4(weight, 32)  # any exact grid in int8 range will do
        return GroupInt8Linear(q.to(torch.int8) - 8, scale, minimum + 8 * scale, 32, None)
    if kind == "int4":
        return Int4Linear(*quantize_int4(weight, 32), 32, None)
    if kind == "fp8":
        q, scale = quantize_fp8(weight)
        return Fp8Linear(q, scale[:, None], None)
    if kind == "fp8_group":
        q, _ = quantize_fp8(weight)
        scale = torch.rand(n, k // 32, generator=torch.Generator().manual_seed(seed)) / 100
        return Fp8Linear(q, scale.to(device), None)
    raise ValueError(kind)


def kernel_args(layer) -> tuple:
    """The stored tensors as the layers' gpu_matmul hands them to the kernel."""
    if isinstance(layer, Int8Linear):
        return layer.qweight, layer.scale[:, None], None, layer.in_features, False
    if isinstance(layer, GroupInt8Linear):
        return layer.qweight, layer.scale, layer.offset, layer.group_size, False
    if isinstance(layer, Int4Linear):
        assert not layer.kernel_layout
        qweight = layer.qweight.view(layer.out_features, layer.in_features // 2)
        return qweight, layer.scale, layer.minimum, layer.group_size, True
    return layer.qweight, layer.scale, None, layer.group_size, False


def relative_error(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    expected = x.double() @ weight.double().T
    return ((y.double() - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()


# -- small cases for the interpreter --------------------------------------------------------

# (kind, rows, out features, in features, forced split-K): odd N everywhere, odd K for the
# per-channel forms, rows around the 16-row tile.
SMALL_CASES = [
    ("int8", 1, 37, 51, None), ("int8", 17, 70, 160, 3), ("int8", 5, 33, 300, None),
    ("group_int8", 3, 45, 96, 2), ("group_int8", 16, 19, 64, None),
    ("int4", 1, 70, 160, None), ("int4", 7, 37, 96, 3), ("int4", 18, 33, 64, None),
    ("fp8", 1, 37, 51, None), ("fp8", 9, 70, 160, 2), ("fp8_group", 2, 45, 96, 3),
]
SMALL_DTYPES = (torch.float32, torch.bfloat16)


def _case_id(case: tuple, dtype: torch.dtype) -> str:
    kind, m, n, k, split = case
    return f"{kind}-m{m}-n{n}-k{k}-split{split}-{str(dtype).removeprefix('torch.')}"


def run_small_cases() -> None:
    """Subprocess entry: print {case id: relative error} as JSON."""
    results = {}
    for case in SMALL_CASES:
        kind, m, n, k, split = case
        layer = make_layer(kind, n, k)
        for dtype in SMALL_DTYPES:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            config = LaunchConfig(16, 32, 64, split_k=split)
            y = weight_only_matmul(x, *kernel_args(layer), config=config)
            assert y.dtype == dtype and y.shape == (m, n)
            results[_case_id(case, dtype)] = relative_error(y, x, layer.dequantize(torch.float64))
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    pytest.importorskip("triton")
    return json.loads(run_interpreted("tests.quantization.test_triton_kernels", "run_small_cases"))


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: _case_id(c, torch.float32).rsplit("-", 1)[0])
def test_interpreted_matches_reference(case, dtype, interpreted_errors) -> None:
    assert interpreted_errors[_case_id(case, dtype)] <= TOLERANCE[dtype]


def test_kernel_declines_what_it_cannot_tile() -> None:
    layer = make_layer("int8", 16, 64)
    x = torch.randn(1, 64)
    # Groups narrower than 16 elements, and 4-bit rows of odd length, go the dense path.
    assert weight_only_matmul(x, layer.qweight, torch.ones(16, 8), None, 8) is None
    assert weight_only_matmul(torch.randn(1, 63), torch.zeros(16, 32, dtype=torch.uint8),
                              torch.ones(16, 1), None, 63, four_bit=True) is None


# -- real shapes on the GPU -----------------------------------------------------------------

GPU_KINDS = ("int8", "group_int8", "int4", "fp8", "fp8_group")
# llama3-8b's linears (fused qkv and gate/up as kvserve runs them), and odd ones.
GPU_SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (1024, 4096),
              (14336, 4096), (4000, 4160), (37, 96), (4099, 2944)]
GPU_ROWS = (1, 3, 16, 33, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_layers_match_reference(kind, dtype) -> None:
    if kind.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    for n, k in GPU_SHAPES:
        layer = make_layer(kind, n, k, device="cuda")
        weight = layer.dequantize(torch.float64)
        for m in GPU_ROWS:
            x = torch.randn(m, k, device="cuda").to(dtype)
            y = layer(x)
            assert y.dtype == dtype
            error = relative_error(y, x, weight)
            # fp8 activations (_scaled_mm, above 16 bf16 rows) cost about 2**-4 per element.
            tolerance = 6e-2 if kind == "fp8" and m > 16 and dtype == torch.bfloat16 else TOLERANCE[dtype]
            assert error <= tolerance, f"{kind} {(m, n, k)} {dtype}: relative error {error:.2e}"


@pytest.mark.gpu
def test_gpu_int4_checkpoint_layout_is_repacked_on_the_device() -> None:
    layer = make_layer("int4", 128, 256)  # built on the CPU in torch's CPU kernel layout
    assert layer.kernel_layout
    weight = layer.dequantize()
    layer = layer.cuda()
    assert not layer.kernel_layout and not hasattr(layer, "kernel_scales_and_zeros")
    assert torch.equal(layer.dequantize().cpu(), weight)
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    assert relative_error(layer(x), x, weight.cuda()) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_kernels_replay_in_a_cuda_graph(kind) -> None:
    if kind.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    layer = make_layer(kind, 1024, 4096, device="cuda")
    static_x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    layer(static_x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(static_y, layer(x))


@pytest.mark.gpu
def test_gpu_kernels_switch_off_to_the_dense_path(monkeypatch) -> None:
    layer = make_layer("int8", 256, 512, device="cuda")
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(base, "gpu_kernels_enabled", False)
    torch.testing.assert_close(layer(x), layer.dense_matmul(x), rtol=0, atol=0)
