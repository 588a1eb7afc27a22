"""The dense linears' and LM head's CPU kernel (kvserve_cpu::float_matmul) against an fp64
reference, and the rows it takes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_executor.layers.linear import KERNEL_MAX_ROWS, Linear, linear
from kvserve.ops.cpu import float_matmul_op


@pytest.mark.parametrize(("rows", "vocab", "hidden"), [(1, 49152, 576), (3, 1001, 37), (16, 517, 64), (2, 7, 8)])
def test_float_matmul_matches_fp64(rows, vocab, hidden):
    """Odd vocabularies (a last tile of fewer than 4 rows) and hidden sizes (a scalar tail
    after the 8-wide vectors)."""
    op = float_matmul_op()
    if op is None:
        pytest.skip("no C++ compiler: the kernel is not built and torch's matmul is used")
    generator = torch.Generator().manual_seed(rows * vocab + hidden)
    x, weight = torch.randn(rows, hidden, generator=generator), torch.randn(vocab, hidden, generator=generator)
    expected = x.double() @ weight.double().T
    got = op(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, vocab)
    # fp32 accumulation of `hidden` products: error well under 1e-6 of the row's magnitude.
    bound = 1e-6 * (x.abs().double() @ weight.abs().double().T)
    assert ((got.double() - expected).abs() <= bound + 1e-7).all()


def _record_torch_matmuls(monkeypatch) -> list[int]:
    """Rows of each call that `linear` hands to torch's F.linear rather than the kernel."""
    import kvserve.model_executor.layers.linear as linear_module

    if float_matmul_op() is None:
        pytest.skip("no C++ compiler: the kernel is not built and torch's matmul is used")
    calls: list[int] = []

    def recording_linear(x, weight, bias=None):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return F.linear(x, weight, bias)

    monkeypatch.setattr(linear_module, "F", SimpleNamespace(linear=recording_linear))
    return calls


def test_head_shaped_linear_takes_the_kernel_only_for_few_fp32_rows(monkeypatch):
    torch_calls = _record_torch_matmuls(monkeypatch)
    weight = torch.randn(33, 16)
    for rows in (1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    linear(torch.randn(2, 16, dtype=torch.float64), weight.double())
    assert torch_calls == [KERNEL_MAX_ROWS + 1, 2]


def test_linear_layer_takes_the_kernel_for_decode_rows(monkeypatch):
    """The model's Linear: bias added, leading dimensions kept, the kernel for up to
    KERNEL_MAX_ROWS fp32 rows (counted over the leading dimensions) and torch's matmul past
    that or for other dtypes, all equal to an fp64 product."""
    torch_calls = _record_torch_matmuls(monkeypatch)
    torch.manual_seed(0)
    layer = Linear(37, 19, bias=True)
    for shape in ((1, 37), (2, 3, 37), (KERNEL_MAX_ROWS, 37), (KERNEL_MAX_ROWS + 1, 37)):
        x = torch.randn(shape)
        expected = x.double() @ layer.weight.double().T + layer.bias.double()
        got = layer(x)
        assert got.shape == (*shape[:-1], 19)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch_calls == [KERNEL_MAX_ROWS + 1]
    torch.testing.assert_close(linear(torch.ones(1, 37, dtype=torch.float64), layer.weight.double()),
                               layer.weight.double().sum(1)[None])
    assert torch_calls == [KERNEL_MAX_ROWS + 1, 1]
