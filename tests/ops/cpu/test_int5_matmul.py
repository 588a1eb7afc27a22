"""kvserve's int4 CPU kernel with a plane of high bits: 5-bit weights (GGUF Q5_0/Q5_1/Q5_K grids),
w = q * scale + minimum with q in [0, 31], against the fp64 product of the dequantized weight on
odd shapes: whole 128-column blocks and 32-column tails, groups of 96 (the unpacked path), tiles
and passes of every length. As for 4-bit weights, the reference rounds x to int16 for the
q * scale part and takes the unrounded x for the minimums."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cpu.int4_reference import reference_terms
from kvserve.quantization.int4 import dequantize_int4
from kvserve.quantization.int5 import Int5Linear, pack_high_bits, unpack_high_bits


def grid(n: int, k: int, group: int, stored: torch.dtype = torch.float32):
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8)
    q[0, :4] = torch.tensor([0, 31, 16, 15], dtype=torch.uint8)  # both ends, and either side of the high bit
    scale = (torch.rand(n, k // group) + 0.1).to(stored)
    minimum = (-16 * scale.float() + torch.randn(n, k // group) * 0.1).to(stored)
    return q, scale, minimum


def low_nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    low = q & 15
    return (low[:, 0::2] | (low[:, 1::2] << 4)).contiguous()


def test_high_bit_plane_layout_round_trips_and_orders_bits_as_the_kernel_reads_them():
    """Whole 128-column blocks: bit L of uint32 mask i is column 4L + i's. Each 32-column chunk
    after them: a uint16 mask of its even columns, then one of its odd columns."""
    torch.manual_seed(0)
    q = torch.randint(0, 32, (5, 352), dtype=torch.uint8)  # 2 blocks + 96 columns
    plane = pack_high_bits(q)
    assert plane.shape == (5, 3 * 16) and plane.dtype == torch.uint8
    assert torch.equal(unpack_high_bits(plane, 352), q >> 4)
    one = torch.zeros(1, 320, dtype=torch.uint8)
    one[0, 128 + 4 * 9 + 2] = 16  # block 1, lane L = 9, nibble i = 2
    one[0, 256 + 32 + 2 * 5 + 1] = 16  # the tail's chunk 1, odd column b = 5
    masks = pack_high_bits(one).view(torch.int32).reshape(3, 4).tolist()
    assert masks[:2] == [[0, 0, 0, 0], [0, 0, 1 << 9, 0]]
    assert masks[2] == [0, (1 << 5) << 16, 0, 0]


@pytest.mark.parametrize("n,k,group", [(37, 64, 32), (64, 576, 32), (130, 1536, 64), (9, 256, 128), (5, 32, 32),
                                       (11, 480, 32), (7, 384, 96), (6, 1024, 256)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("stored", [torch.float32, torch.float16])
def test_int5_matmul_equals_the_dequantized_matmul(int4_matmul, n, k, group, rows, stored):
    torch.manual_seed(n * k + rows)
    q, scale, minimum = grid(n, k, group, stored)
    x = torch.randn(rows, k)
    x[0, 0] = 0.0
    x_scale, x_rounded, scaled, offsets = reference_terms(x, q, scale, minimum)
    y = int4_matmul(x, low_nibble_pairs(q), scale, minimum, group, pack_high_bits(q))
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    reference = x_rounded @ scaled.T + x.double() @ offsets.T
    # fp32 sums of terms that largely cancel (minimums near -16 scales): error relative to their magnitudes
    magnitude = x_rounded.abs() @ scaled.abs().T + x.double().abs() @ offsets.abs().T
    assert ((y.double() - reference).abs() <= 2e-6 * magnitude + 1e-5).all()


@pytest.mark.parametrize("n,k,group", [(1536, 576, 32), (38, 384, 96), (10, 1024, 256)])
def test_a_rows_result_does_not_depend_on_the_row_count(int4_matmul, n, k, group):
    torch.manual_seed(k + group)
    q, scale, minimum = grid(n, k, group)
    args = (low_nibble_pairs(q), scale, minimum, group, pack_high_bits(q))
    x = torch.randn(17, k)
    one_row = torch.cat([int4_matmul(x[i : i + 1], *args) for i in range(17)])
    for rows in (2, 3, 5, 16, 17):
        assert torch.equal(int4_matmul(x[:rows], *args), one_row[:rows]), rows


def test_bad_high_bit_planes_name_what_is_wrong(int4_matmul):
    q, scale, minimum = grid(8, 256, 32)
    packed, plane = low_nibble_pairs(q), pack_high_bits(q)
    with pytest.raises(RuntimeError, match=r"high must be contiguous uint8 \[N, 32\]"):
        int4_matmul(torch.randn(1, 256), packed, scale, minimum, 32, plane[:, :16])
    with pytest.raises(RuntimeError, match="high must be contiguous uint8"):
        int4_matmul(torch.randn(1, 256), packed, scale, minimum, 32, plane.to(torch.int32))


def test_int5_linear_runs_the_kernel_and_dequantizes_exactly(int4_matmul):
    """fp16 scales where fp16 holds them exactly (Q5_0/Q5_1's d and m), fp32 otherwise; the
    layer's weight is the grid's, and its decode rows run the kernel on its nibbles and plane."""
    torch.manual_seed(1)
    q, scale, minimum = grid(40, 576, 32)
    exact = Int5Linear(q, scale.half().float(), minimum.half().float(), 32, None)
    assert exact.scale.dtype == torch.float16 and exact.own_kernel is not None
    inexact = Int5Linear(q, scale, minimum, 32, torch.randn(40))
    assert inexact.scale.dtype == torch.float32
    assert torch.equal(inexact.dequantize(), dequantize_int4(q, scale, minimum))
    assert inexact.weight_bytes() < 40 * 576 * 6 / 8 + 40 * 18 * 8 + 40 * 4 + 1
    x = torch.randn(2, 576)
    kernel = int4_matmul(x, low_nibble_pairs(q), scale, minimum, 32, pack_high_bits(q))
    torch.testing.assert_close(inexact(x), kernel + inexact.bias, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"q in \[0, 31\]"):
        Int5Linear(q | 32, scale, minimum, 32, None)
