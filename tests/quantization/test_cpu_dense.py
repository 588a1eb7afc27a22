"""Dense CPU weights packed in oneDNN's layout against F.linear on the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.quantization.cpu_dense import dense_linear, pack_dense_weight, plain_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 77])
def test_packed_weight_computes_the_plain_matmul(dtype, rows):
    torch.manual_seed(rows)
    weight = torch.randn(37, 51)  # odd shapes: no block multiple
    packed = pack_dense_weight(weight, dtype)
    assert torch.equal(plain_weight(packed), weight.to(dtype))
    x = torch.randn(2, rows, 51)  # fp32 activations, a leading batch dimension
    y = dense_linear(x, packed)
    reference = F.linear(x.to(dtype), weight.to(dtype)).float()  # the same op, plain layout
    assert y.dtype == torch.float32 and y.shape == (2, rows, 37)
    if dtype == torch.float32:
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    else:  # both bf16 GEMMs accumulate in fp32; only the order of the sums may differ
        torch.testing.assert_close(y, reference, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y, x @ weight.t(), rtol=0.05, atol=0.1)
