"""kvserve's own int8 CPU kernel against an fp64 reference of the dequantized weight, on
odd shapes (row counts that are no multiple of its four-row tile, columns that are no
multiple of its 16 lanes, more columns than one int32 chunk holds), eager and compiled.

The kernel rounds each activation row to int16 (scale = the row's largest |x| / 32767): the
reference does the same rounding (in fp32, as the kernel: x * (1 / scale)) and must agree to
fp32 accuracy, and the distance to the unrounded product is held to that rounding's bound."""

from __future__ import annotations

import pytest
import torch

from kvserve.quantization.int8 import quantize_int8


@pytest.mark.parametrize("n,k", [(37, 51), (64, 576), (130, 1536), (1, 8), (9, 8200)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_matmul_equals_the_dequantized_matmul(int8_matmul, n, k, rows):
    torch.manual_seed(n * k + rows)
    q, scale = quantize_int8(torch.randn(n, k))
    q[0, :3] = torch.tensor([-128, 127, -128], dtype=torch.int8)  # the int32 bound's extremes
    x = torch.randn(rows, k)
    x[0, 0] = 0.0
    weight = q.double() * scale.double()[:, None]
    x_scale = x.abs().amax(dim=1, keepdim=True) / 32767
    x_rounded = torch.round(x * (1 / x_scale)).double() * x_scale.double()
    y = int8_matmul(x, q, scale)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), x_rounded @ weight.T, rtol=1e-5, atol=1e-4)
    bound = x_scale.double() / 2 * weight.abs().sum(dim=1) + 1e-4
    assert ((y.double() - x.double() @ weight.T).abs() <= bound).all()


@pytest.mark.parametrize("n,k,group", [(37, 64, 32), (64, 576, 32), (9, 96, 16), (130, 1536, 128), (5, 48, 48)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_matmul_with_group_scales_equals_the_dequantized_matmul(int8_matmul, n, k, group, rows):
    """Scales [N, K / group]: each group's int32 dot product takes its own scale."""
    torch.manual_seed(n * k + rows + group)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    q[0, :group] = 127  # a whole group at the int32 bound
    scale = torch.rand(n, k // group) * 0.1 + 1e-3
    x = torch.randn(rows, k)
    weight = (q.double().reshape(n, -1, group) * scale.double()[..., None]).reshape(n, k)
    x_scale = x.abs().amax(dim=1, keepdim=True) / 32767
    x_rounded = torch.round(x * (1 / x_scale)).double() * x_scale.double()
    y = int8_matmul(x, q, scale)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), x_rounded @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n,k,group", [(37, 64, 32), (64, 576, 16), (130, 1536, 128), (9, 200, 200)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_matmul_with_group_offsets_equals_the_dequantized_matmul(int8_matmul, n, k, group, rows):
    """w = q * scale + offset per group (GGUF Q5_K, Q4_K held as int8): the offsets meet the
    unrounded group sums of x, so the reference rounds x only in the q * scale part; one
    whole-row group (k = group = 200) too."""
    torch.manual_seed(n * k + rows + group + 1)
    q = torch.randint(0, 32, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // group) * 0.01 + 1e-4
    offset = -torch.rand(n, k // group) * 0.2
    x = torch.randn(rows, k)
    x[-1] = 0.0  # a zero row: its int16 scale is the 1.0 fallback, its sums 0
    scaled = (q.double().reshape(n, -1, group) * scale.double()[..., None]).reshape(n, k)
    offsets = offset.double().repeat_interleave(group, dim=1)
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 32767
    x_rounded = torch.round(x * (1 / x_scale)).double() * x_scale.double()
    y = int8_matmul(x, q, scale, offset)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), x_rounded @ scaled.T + x.double() @ offsets.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[-1], torch.zeros(n))
    # Each row's result is the same at every row count (batch-invariant decode).
    for i in range(rows):
        assert torch.equal(int8_matmul(x[i:i + 1], q, scale, offset), y[i:i + 1]), i


def test_int8_matmul_rejects_groups_it_cannot_take(int8_matmul):
    q = torch.zeros(4, 48, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        int8_matmul(torch.randn(1, 48), q, torch.ones(4, 6))  # groups of 8 columns


def test_int8_matmul_of_zero_rows_is_zero(int8_matmul):
    q, scale = quantize_int8(torch.randn(8, 32))
    assert torch.equal(int8_matmul(torch.zeros(2, 32), q, scale), torch.zeros(2, 8))


def test_int8_matmul_inside_a_compiled_graph(int8_matmul):
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(96, 64))

    offset = torch.randn(96, 1)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(int8_matmul(x * 2, q, scale)) + int8_matmul(x, q, scale, offset)

    compiled = torch.compile(forward, fullgraph=True)
    x = torch.randn(2, 64)
    torch.testing.assert_close(compiled(x), forward(x), rtol=0, atol=0)


def test_bad_inputs_name_what_is_wrong(int8_matmul):
    q, scale = quantize_int8(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="x has 15 columns, q 16"):
        int8_matmul(torch.randn(1, 15), q, scale)
    with pytest.raises(RuntimeError, match="x must be 2-D fp32"):
        int8_matmul(torch.randn(1, 16, dtype=torch.float64), q, scale)
    with pytest.raises(RuntimeError, match="offset must be fp32 shaped as scale"):
        int8_matmul(torch.randn(1, 16), q, scale, torch.zeros(8, 2))


def test_int8_matmul_does_not_overflow_its_int32_sums(int8_matmul):
    """Every product at its largest (|q| = 128, x at its row maximum) over two int32 chunks:
    without the flush the sums would wrap."""
    k = 8200
    q = torch.full((4, k), -128, dtype=torch.int8)
    scale = torch.ones(4)
    y = int8_matmul(torch.ones(1, k), q, scale)
    torch.testing.assert_close(y, torch.full((1, 4), -128.0 * k), rtol=1e-6, atol=0)
