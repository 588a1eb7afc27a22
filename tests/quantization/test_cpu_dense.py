"""Dense CPU weights packed in oneDNN's layout against F.linear on the plain weight, eager
and inside a torch.compile'd graph (the compiled CPU decode step calls them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.quantization.cpu_dense import DenseWeight, packing_supported


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 77])
def test_packed_weight_computes_the_plain_matmul(dtype, rows):
    torch.manual_seed(rows)
    weight = torch.randn(37, 51)  # odd shapes: no block multiple
    dense = DenseWeight(weight, dtype)
    # fp32 packs on every CPU; bf16 needs AVX-512 or AVX-NE-CONVERT, else the plain weight.
    packed = dtype == torch.float32 or packing_supported(torch.bfloat16)
    assert (dense.handle is not None) == packed and dense.tensor.is_mkldnn == packed
    assert torch.equal(dense.plain(), weight.to(dtype))
    x = torch.randn(2, rows, 51)  # fp32 activations, a leading batch dimension
    y = dense.linear(x)
    reference = F.linear(x.to(dtype), weight.to(dtype)).float()  # the same op, plain layout
    assert y.dtype == torch.float32 and y.shape == (2, rows, 37)
    if dtype == torch.float32:
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    else:  # both bf16 GEMMs accumulate in fp32; only the order of the sums may differ
        torch.testing.assert_close(y, reference, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y, x @ weight.t(), rtol=0.05, atol=0.1)


def test_unpacked_weight_is_the_callers_tensor():
    weight = torch.randn(8, 16)
    dense = DenseWeight(weight, torch.float32, pack=False)
    assert dense.handle is None and dense.tensor.data_ptr() == weight.data_ptr()
    x = torch.randn(3, 16)
    assert torch.equal(dense.linear(x), F.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weight_inside_a_compiled_graph(dtype):
    if not packing_supported(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} weights on this CPU")
    torch.manual_seed(0)
    first, second = DenseWeight(torch.randn(48, 32), dtype), DenseWeight(torch.randn(32, 48), dtype)
    assert first.handle is not None and second.handle is not None

    def forward(x: torch.Tensor) -> torch.Tensor:
        return second.linear(torch.relu(first.linear(x)))

    compiled = torch.compile(forward, fullgraph=True)
    for rows in (3, 9):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(compiled(x), forward(x), rtol=0, atol=0)
