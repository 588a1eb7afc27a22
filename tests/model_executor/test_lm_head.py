"""The LM head's CPU kernel (kvserve_cpu::float_matmul) against an fp64 reference, and the
rows it takes."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_executor.layers.lm_head import KERNEL_MAX_ROWS, lm_head_logits
from kvserve.quantization.cpu_kernels import float_matmul_op


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


def test_lm_head_takes_the_kernel_only_for_few_fp32_rows(monkeypatch):
    calls = []
    op = float_matmul_op()
    if op is None:
        pytest.skip("no C++ compiler")
    import kvserve.model_executor.layers.lm_head as lm_head

    monkeypatch.setattr(lm_head, "float_matmul_op", lambda: lambda x, w: calls.append(x.shape[0]) or op(x, w))
    weight = torch.randn(33, 16)
    for rows in (1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(lm_head_logits(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    lm_head_logits(torch.randn(2, 16, dtype=torch.float64), weight.double())
    assert calls == [1, KERNEL_MAX_ROWS]
