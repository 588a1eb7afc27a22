"""CPU weights take kvserve's own CPU kernels on a machine that also has a GPU (`--device
cpu` there): the layers choose by the weights' device, not by whether CUDA exists. With
torch's int8 kernel instead (bf16 activations), a row's error grows ~100x; the reference is
the fp64 product of the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from kvserve.ops.cpu import int4_matmul_op, int8_matmul_op
from kvserve.quantization.int4 import Int4Linear, quantize_int4
from kvserve.quantization.int8 import GroupInt8Linear, Int8Linear, quantize_int8_groups


@pytest.fixture
def gpu_host(monkeypatch):
    if int8_matmul_op() is None or int4_matmul_op() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _layers():
    torch.manual_seed(0)
    dense = torch.nn.Linear(256, 96, bias=False)
    q, scale = quantize_int8_groups(dense.weight, 32)
    return [Int8Linear(dense), GroupInt8Linear(q, scale, None, 32, None),
            Int4Linear(*quantize_int4(dense.weight, 32), 32, None)]


def test_cpu_weights_take_kvserves_kernels_where_cuda_exists(gpu_host):
    x = torch.randn(3, 256)
    for layer in _layers():
        assert layer.own_kernel is not None, type(layer).__name__
        reference = x.double() @ layer.dequantize().double().T
        # int16 activations: ~1e-5 of the row's largest |x|; bf16 ones would be ~4e-3.
        torch.testing.assert_close(layer(x).double(), reference, rtol=0, atol=5e-4)
