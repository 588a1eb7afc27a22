"""kvserve's own int4 CPU kernel (nibble pairs, group scales and float minimums) against an
fp64 product of the dequantized weight, on odd shapes: row counts that are no multiple of its
four-row tile or two-row passes, group sizes 32 to 128, one group or many.

As the int8 kernel it rounds each activation row to int16 (scale = the row's largest |x| /
32767): the reference applies the same rounding to the q * scale part and the unrounded x to
the minimums (which the kernel sums in fp32), and must agree to fp32 accuracy."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cpu.int4_reference import reference_terms
from kvserve.quantization.int4 import Int4Linear, dequantize_int4, quantize_int4


def nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 as [N, K / 2] bytes, even k in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


# One row of x takes whole 128-column blocks first (groups of 32-128, or multiples of 128),
# then 32-column chunks: 576 = 4 blocks + 64, 480 = 3 + 96; groups of 96 keep the chunks.
@pytest.mark.parametrize("n,k,group", [(37, 64, 32), (64, 576, 32), (130, 1536, 64), (9, 256, 128), (5, 32, 32),
                                       (11, 480, 32), (7, 384, 96), (6, 1024, 256)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("stored", [torch.float32, torch.float16])
def test_int4_matmul_equals_the_dequantized_matmul(int4_matmul, n, k, group, rows, stored):
    """Scales and minimums stored as fp32, or as fp16 (GGUF Q4_1's d and m): the reference
    takes the stored values."""
    torch.manual_seed(n * k + rows)
    q, scale, minimum = quantize_int4(torch.randn(n, k), group)
    scale, minimum = scale.to(stored), minimum.to(stored)
    q[0, :2] = torch.tensor([0, 15], dtype=torch.uint8)  # both ends of the nibble range
    x = torch.randn(rows, k)
    x[0, 0] = 0.0
    x_scale, x_rounded, scaled, offsets = reference_terms(x, q, scale, minimum)
    y = int4_matmul(x, nibble_pairs(q), scale, minimum, group)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), x_rounded @ scaled.T + x.double() @ offsets.T, rtol=1e-5, atol=1e-4)
    weight = dequantize_int4(q, scale, minimum).double()
    bound = x_scale.double() / 2 * scaled.abs().sum(dim=1) + 1e-4
    assert ((y.double() - x.double() @ weight.T).abs() <= bound).all()


def test_int4_matmul_inside_a_compiled_graph(int4_matmul):
    torch.manual_seed(0)
    q, scale, minimum = quantize_int4(torch.randn(96, 64), 32)
    packed = nibble_pairs(q)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(int4_matmul(x * 2, packed, scale, minimum, 32))

    compiled = torch.compile(forward, fullgraph=True)
    x = torch.randn(2, 64)
    torch.testing.assert_close(compiled(x), forward(x), rtol=0, atol=0)


def test_bad_inputs_name_what_is_wrong(int4_matmul):
    q, scale, minimum = quantize_int4(torch.randn(8, 64), 32)
    packed = nibble_pairs(q)
    with pytest.raises(RuntimeError, match="group size 48 must be a multiple of 32"):
        int4_matmul(torch.randn(1, 64), packed, scale, minimum, 48)
    with pytest.raises(RuntimeError, match="nibble pairs"):
        int4_matmul(torch.randn(1, 64), q, scale, minimum, 32)
    with pytest.raises(RuntimeError, match="scale and minimum must be both fp32 or both fp16"):
        int4_matmul(torch.randn(1, 64), packed, scale[:, :1], minimum, 32)
    with pytest.raises(RuntimeError, match="scale and minimum must be both fp32 or both fp16"):
        int4_matmul(torch.randn(1, 64), packed, scale.half(), minimum, 32)
    with pytest.raises(RuntimeError, match="x must be 2-D fp32"):
        int4_matmul(torch.randn(1, 64, dtype=torch.float64), packed, scale, minimum, 32)


def test_layers_keep_fp16_scales_where_fp16_holds_them_exactly(int4_matmul):
    """Int4Linear on this kernel stores its scales and minimums in fp16 when every one is an
    fp16 value (GGUF Q4_1's d and m), with outputs equal bit for bit to the fp32 ones'; other
    scales stay fp32."""
    torch.manual_seed(0)
    q, scale, minimum = quantize_int4(torch.randn(64, 576), 32)
    scale16, minimum16 = scale.half().float(), minimum.half().float()
    exact = Int4Linear(q, scale16, minimum16, 32, None)
    assert exact.cpu_kernel == "kvserve"
    assert exact.scale.dtype == torch.float16 and exact.minimum.dtype == torch.float16
    inexact = Int4Linear(q, scale, minimum, 32, None)
    assert inexact.scale.dtype == torch.float32 and inexact.minimum.dtype == torch.float32
    for rows in (1, 3):
        x = torch.randn(rows, 576)
        assert torch.equal(exact.kernel_matmul(x), int4_matmul(x, nibble_pairs(q), scale16, minimum16, 32))


# The shapes' every path: whole 128-column blocks and a 32-column tail (576), blocks only
# (1536, groups of 64 or 256), groups of 96 (no blocks), a last tile of fewer than four rows (n).
@pytest.mark.parametrize("n,k,group", [(1536, 576, 32), (577, 1536, 64), (38, 384, 96), (10, 1024, 256)])
@pytest.mark.parametrize("stored", [torch.float32, torch.float16])
def test_a_rows_result_does_not_depend_on_the_row_count(int4_matmul, n, k, group, stored):
    """Bit for bit: the batch-invariant serving plan runs every decode row on this kernel, so
    a request's greedy tokens must not change with how many others share its step. One-row
    calls are the reference; odd counts end in a one-row pass, even ones in paired passes."""
    torch.manual_seed(k + group)
    q, scale, minimum = quantize_int4(torch.randn(n, k), group)
    packed, scale, minimum = nibble_pairs(q), scale.to(stored), minimum.to(stored)
    x = torch.randn(33, k)
    one_row = torch.cat([int4_matmul(x[i : i + 1], packed, scale, minimum, group) for i in range(33)])
    for rows in (2, 3, 4, 5, 8, 16, 17, 32, 33):
        assert torch.equal(int4_matmul(x[:rows], packed, scale, minimum, group), one_row[:rows]), rows
