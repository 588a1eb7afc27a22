"""RMSNorm fused into the int4 and fp8 linears around it (PendingNorm): the producer's
epilogue adds its output to the residual stream and leaves the norm's sums, the consumer
scales its output rows. Checked against the unfused chain computed in fp64 from the same
stored weights: y1 = x W1^T rounded to the run dtype, h = residual + y1 rounded, RMSNorm(h)
as the torch path rounds it, then y2 = RMSNorm(h) W2^T.

Without a GPU the int4 word kernel (producer and consumer) and the fp8 byte kernel
(consumer) run under Triton's interpreter (one subprocess), and so do the mma.sync kernels'
two fused epilogues alone (their main loops are inline PTX); on CUDA llama3-8b's two pairs run
the one-row kernels of each format (int4: the word kernel and mma.sync; fp8: mma.sync and
the byte kernel), and mma.sync finishes pending rows at 2-32 rows. The engine-level decode
test is in tests/gpu/test_quantized_engine_gpu.py."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import torch
import triton
import triton.language as tl

from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.ops.pending_norm import PendingNorm
from kvserve.ops.quant.weight_only import LaunchConfig, mma
from kvserve.ops.quant.weight_only.matmul import (
    AddNorm,
    weight_only_matmul,
    weight_only_matmul_add_norm,
)
from kvserve.quantization.fp8 import Fp8Linear, quantize_fp8
from kvserve.quantization.int4 import Int4Linear, quantize_int4
from tests.triton_interpreter import run_interpreted

EPS = 1e-5
# Worst relative error per row against the fp64 chain: the run dtype's rounding of x, y1, h
# and of the consumer's input, a few ulps.
TOLERANCE = {torch.float32: 3e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


class ChainCase(NamedTuple):
    """x [rows, k] -> producer (hidden x k) -> add + norm -> consumer (n x hidden), each in
    its weight format ("int4" in groups of group_size; "fp8" per channel where group_size is
    0, else in groups); the int4 producer's config (block_m, block_n, block_k, split), None
    for default_config."""
    rows: int
    k: int
    hidden: int
    n: int
    group_size: int
    config: tuple[int, int, int, int | None] | None = None
    producer: str = "int4"
    consumer: str = "int4"
    consumer_group_size: int | None = None  # None: group_size

    @property
    def id(self) -> str:
        formats = "" if (self.producer, self.consumer) == ("int4", "int4") else f"-{self.producer}-{self.consumer}"
        if self.consumer_group_size is not None:
            formats += f"-g{self.consumer_group_size}"
        return f"m{self.rows}-k{self.k}-h{self.hidden}-n{self.n}-g{self.group_size}-{self.config}{formats}"


# 3 and 4 column blocks of the hidden size (the sums' partial count not a power of two, and
# one), split K, several rows of the CUDA-core kernel, the default one-row config.
CHAIN_CASES = [
    ChainCase(1, 512, 192, 37, 64, (1, 64, 128, 2)),
    ChainCase(1, 256, 256, 21, 128, (1, 64, 256, None)),
    ChainCase(3, 512, 192, 19, 64, (4, 64, 128, 3)),
    ChainCase(1, 512, 256, 37, 128),
    # The fp8 byte kernel (one row of x a program, split K) finishing an int4 producer's norm,
    # its weight scaled in groups of 64 inputs or per channel.
    ChainCase(1, 512, 192, 37, 64, (1, 64, 128, 2), consumer="fp8"),
    ChainCase(3, 512, 256, 21, 64, (4, 64, 128, None), consumer="fp8", consumer_group_size=0),
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _layer(fmt: str, n: int, k: int, group_size: int, seed: int, device: str) -> Int4Linear | Fp8Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(device)
    if fmt == "fp8":  # group_size 0: a scale per output channel, else per group of inputs
        q, scale = quantize_fp8(weight.reshape(-1, group_size or k))
        return Fp8Linear(q.reshape(n, k), scale.reshape(n, -1), None)
    return Int4Linear(*quantize_int4(weight, group_size), group_size, None)


def _int4_layer(n: int, k: int, group_size: int, seed: int, device: str) -> Int4Linear:
    return _layer("int4", n, k, group_size, seed, device)


def _stored(layer: Int4Linear | Fp8Linear) -> dict:
    """The layer's weight as weight_only_matmul's keyword arguments."""
    if isinstance(layer, Fp8Linear):
        return dict(qweight=layer.qweight, scale=layer.scale, offset=None, group_size=layer.group_size)
    qweight = layer.qweight.view(layer.out_features, layer.in_features // 2)
    return dict(qweight=qweight, scale=layer.scale, offset=layer.minimum, group_size=layer.group_size, four_bit=True)


def _weight(layer: Int4Linear | Fp8Linear) -> torch.Tensor:
    if isinstance(layer, Fp8Linear):  # e4m3 values times their scales, exact in fp64
        n, k = layer.qweight.shape
        groups = layer.qweight.double().reshape(n, -1, layer.group_size)
        return (groups * layer.scale.double()[..., None]).reshape(n, k)
    return layer.dequantize(torch.float64)


def _relative(y: torch.Tensor, expected: torch.Tensor) -> float:
    y, expected = y.double().cpu(), expected.double().cpu()
    return ((y - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()


def chain_errors(case: ChainCase, dtype: torch.dtype, device: str) -> dict[str, float]:
    """Relative errors of the fused chain's outputs (residual, finished norm, consumer
    output through the kernel and through finish()) against the fp64 chain."""
    generator = torch.Generator().manual_seed(case.k + case.rows)
    x = torch.randn(case.rows, case.k, generator=generator).to(dtype).to(device)
    residual = (torch.randn(case.rows, case.hidden, generator=generator) * 4).to(dtype).to(device)
    norm = RMSNorm(case.hidden, EPS).to(device)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(case.hidden, generator=generator) * 0.1)
    norm = norm.to(dtype)
    producer = _layer(case.producer, case.hidden, case.k, case.group_size, 1, device)
    consumer_group_size = case.group_size if case.consumer_group_size is None else case.consumer_group_size
    consumer = _layer(case.consumer, case.n, case.hidden, consumer_group_size, 2, device)

    y1 = (x.double() @ _weight(producer).T.to(device)).to(dtype)
    h = residual + y1
    expected_norm = norm._norm(h)  # the torch path's roundings
    expected_y2 = expected_norm.double() @ _weight(consumer).T.to(device)

    config = None if case.config is None else LaunchConfig(*case.config[:3], split_k=case.config[3], words="fma")
    fused = weight_only_matmul_add_norm(x, **_stored(producer), add_norm=AddNorm(residual, norm.weight),
                                        config=config)
    assert fused is not None
    pending = PendingNorm(*fused, EPS)
    assert pending.sums.shape == (case.rows, -(-case.hidden // (config or LaunchConfig(1, 128, 256)).block_n))
    # On the CPU: the consumer's one-row kernel with K split in two (int4: the word kernel;
    # fp8: the byte kernel).
    consumer_config = None
    if device == "cpu":
        consumer_config = LaunchConfig(1, 16, 64, split_k=2, words="fma" if case.consumer == "int4" else None)
    y2 = weight_only_matmul(pending.rows, **_stored(consumer), pending=pending, config=consumer_config)
    assert y2 is not None and y2.dtype == dtype
    finished_y2 = weight_only_matmul(pending.finish(), **_stored(consumer))
    return {
        "residual": _relative(residual, h),
        "sums": abs(pending.sums.double().sum().item() / residual.double().pow(2).sum().item() - 1),
        "norm": _relative(pending.finish(), expected_norm),
        "consumer": _relative(y2, expected_y2),
        "consumer_after_finish": _relative(finished_y2, expected_y2),
    }


@triton.jit
def _load_accumulators(y_ptr, t, w_row, M, N, X_TILES: tl.constexpr):
    """y [M, N] (fp32, row-major) as an mma.sync kernel's accumulators hold it: of x tile j,
    weight rows g and g + 8 against x rows 8 j + 2 t and 8 j + 2 t + 1."""
    w_row8 = w_row + 8
    ys = ()
    for j in tl.static_range(X_TILES):
        x_row = (8 * j + 2 * t)[:, None]
        ys = ys + (tl.load(y_ptr + x_row * N + w_row, mask=(x_row < M) & (w_row < N), other=0.0),
                   tl.load(y_ptr + (x_row + 1) * N + w_row, mask=(x_row + 1 < M) & (w_row < N), other=0.0),
                   tl.load(y_ptr + x_row * N + w_row8, mask=(x_row < M) & (w_row8 < N), other=0.0),
                   tl.load(y_ptr + (x_row + 1) * N + w_row8, mask=(x_row + 1 < M) & (w_row8 < N), other=0.0))
    return ys


@triton.jit
def _mma_add_norm_epilogue_kernel(y_ptr, partial_ptr, out_ptr, count_ptr, residual_ptr, norm_weight_ptr,
                                  sum_squares_ptr, M, N, SPLIT: tl.constexpr, ROW_TILES: tl.constexpr,
                                  NUM_WARPS: tl.constexpr, X_TILES: tl.constexpr):
    """The mma.sync kernels' add-and-norm epilogue alone (no inline PTX, so the interpreter
    runs it): each split's y [M, N] read into the accumulators' layout, then
    _mma_store_add_norm."""
    g, t, w_row, w_row8 = mma._mma_weight_rows(ROW_TILES, NUM_WARPS)
    ys = _load_accumulators(y_ptr + tl.program_id(2) * M * N, t, w_row, M, N, X_TILES)
    mma._mma_store_add_norm(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, N, M * N, residual_ptr,
                            norm_weight_ptr, sum_squares_ptr, SPLIT, X_TILES)


@triton.jit
def _mma_row_scale_epilogue_kernel(y_ptr, out_ptr, pending_ptr, M, N, pending_partials, num_cols, eps,
                                   PARTIALS: tl.constexpr, ROW_TILES: tl.constexpr, NUM_WARPS: tl.constexpr,
                                   X_TILES: tl.constexpr):
    """The mma.sync kernels' ROW_SCALE epilogue alone: y [M, N] read into the accumulators'
    layout, each row scaled by its pending norm's factor, stored (no split)."""
    g, t, w_row, w_row8 = mma._mma_weight_rows(ROW_TILES, NUM_WARPS)
    ys = _load_accumulators(y_ptr, t, w_row, M, N, X_TILES)
    scales = mma._mma_row_scales(pending_ptr, t, M, pending_partials, num_cols, eps, PARTIALS, X_TILES)
    mma._mma_store(mma._mma_scale_rows(ys, scales, X_TILES), t, w_row, M, N, out_ptr, out_ptr, out_ptr, N, 0,
                   False, X_TILES)


def mma_row_scale_error(rows: int, n: int) -> float:
    """_mma_row_scales and _mma_scale_rows against torch: y times rsqrt(mean(h^2) + eps) from
    3 partial sums a row (relative error of the fp32 output)."""
    generator = torch.Generator().manual_seed(rows + n)
    y = torch.randn(rows, n, generator=generator)
    sums = torch.rand(rows, 3, generator=generator) * 50 * (1 + torch.arange(rows)[:, None])
    num_cols = 96
    out = torch.zeros(rows, n)
    programs = -(-n // 64)
    _mma_row_scale_epilogue_kernel[(programs, 1, 1)](
        y, out, sums, rows, n, 3, num_cols, EPS, PARTIALS=4, ROW_TILES=2, NUM_WARPS=2, X_TILES=-(-rows // 8))
    expected = y * torch.rsqrt(sums.sum(1, keepdim=True) / num_cols + EPS)
    return _relative(out, expected)


# (rows, N, splits, dtype): 1-2 x tiles, weight rows past N masked, split K or not.
MMA_EPILOGUE_CASES = [(1, 200, 3, torch.bfloat16), (3, 200, 1, torch.float32), (11, 136, 2, torch.float16)]
MMA_ROW_SCALE_ROWS = (1, 5, 13)


def mma_epilogue_errors(rows: int, n: int, splits: int, dtype: torch.dtype) -> dict[str, float]:
    """_mma_store_add_norm against torch on the same partial sums: the residual, out and the
    sums' relative errors, and the counters left (must be 0)."""
    generator = torch.Generator().manual_seed(rows * n)
    partials = torch.randn(splits, rows, n, generator=generator)
    residual = (torch.randn(rows, n, generator=generator) * 3).to(dtype)
    weight = (1 + torch.randn(n, generator=generator) * 0.1).to(dtype)
    h = (partials.sum(0).to(dtype).float() + residual.float()).to(dtype)
    row_tiles, num_warps = 2, 2
    block = 16 * row_tiles * num_warps
    programs = -(-n // block)
    expected_sums = torch.nn.functional.pad(h.float().pow(2), (0, programs * block - n)).reshape(
        rows, programs, block).sum(-1)
    out = torch.empty(rows, n, dtype=dtype)
    sums = torch.empty(rows, programs)
    counters = torch.zeros(programs, dtype=torch.int32)
    new_residual = residual.clone()
    _mma_add_norm_epilogue_kernel[(programs, 1, splits)](
        partials, torch.empty_like(partials), out, counters, new_residual, weight, sums, rows, n,
        SPLIT=splits > 1, ROW_TILES=row_tiles, NUM_WARPS=num_warps, X_TILES=-(-rows // 8))
    return {"residual": _relative(new_residual, h), "out": _relative(out, (h.float() * weight.float()).to(dtype)),
            "sums": ((sums - expected_sums).abs().max() / expected_sums.abs().max()).item(),
            "counters": counters.abs().sum().item()}


def run_chain_cases() -> None:
    """Subprocess entry: print {case: errors} as JSON."""
    results = {f"{case.id}-{str(dtype).removeprefix('torch.')}": chain_errors(case, dtype, "cpu")
               for case in CHAIN_CASES for dtype in DTYPES}
    results |= {f"mma-epilogue-{case}": mma_epilogue_errors(*case) for case in MMA_EPILOGUE_CASES}
    results |= {f"mma-row-scale-{rows}": mma_row_scale_error(rows, 200) for rows in MMA_ROW_SCALE_ROWS}
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_chains() -> dict[str, dict[str, float]]:
    pytest.importorskip("triton")
    return json.loads(run_interpreted("tests.ops.quant.test_fused_norm", "run_chain_cases"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CHAIN_CASES, ids=lambda case: case.id)
def test_interpreted_fused_norm_chain_matches_unfused(case, dtype, interpreted_chains) -> None:
    errors = interpreted_chains[f"{case.id}-{str(dtype).removeprefix('torch.')}"]
    assert errors["sums"] <= 1e-6
    for output in ("residual", "norm", "consumer", "consumer_after_finish"):
        assert errors[output] <= TOLERANCE[dtype], (output, errors)


@pytest.mark.parametrize("rows", MMA_ROW_SCALE_ROWS)
def test_interpreted_mma_row_scales_match_torch(rows, interpreted_chains) -> None:
    """The mma.sync kernels' ROW_SCALE epilogue (int4 and fp8 consumers of a pending norm):
    each x row, of 1 or 2 x tiles, scaled by its own factor."""
    assert interpreted_chains[f"mma-row-scale-{rows}"] <= 1e-6


@pytest.mark.parametrize("case", MMA_EPILOGUE_CASES, ids=str)
def test_interpreted_mma_add_norm_epilogue_matches_torch(case, interpreted_chains) -> None:
    """The fp8 mma.sync kernel's fused epilogue (ADD_NORM): the residual stream updated to h,
    out = h * the norm's weight, each row's sum of h^2 per program, the counters re-armed."""
    errors = interpreted_chains[f"mma-epilogue-{case}"]
    assert errors["counters"] == 0
    assert errors["sums"] <= 1e-6
    assert errors["residual"] == 0 and errors["out"] == 0, errors


def test_add_norm_declines_what_its_kernel_does_not_run() -> None:
    """Nothing is written where the call would not run on the CUDA-core word kernel: more
    rows than its config (tl.dot tiles), or a residual that is not [rows, N] contiguous."""
    producer = _int4_layer(64, 256, 64, 1, "cpu")
    x = torch.randn(3, 256)
    residual = torch.randn(3, 64)
    before = residual.clone()
    dot = LaunchConfig(16, 32, 64, words="dot")
    assert weight_only_matmul_add_norm(x, **_stored(producer), add_norm=AddNorm(residual, torch.ones(64)),
                                       config=dot) is None
    assert weight_only_matmul_add_norm(x, **_stored(producer), add_norm=AddNorm(residual[:, :32], torch.ones(32)),
                                       config=LaunchConfig(4, 32, 64, words="fma")) is None
    # fp8 weights leave a norm pending from mma.sync only (CUDA, one row): here the word kernel.
    fp8 = _layer("fp8", 64, 256, 0, 1, "cpu")
    assert weight_only_matmul_add_norm(x[:1], **_stored(fp8), add_norm=AddNorm(residual[:1], torch.ones(64))) is None
    assert torch.equal(residual, before)


def test_pending_norm_finishes_as_rmsnorm() -> None:
    """finish() from rows = h * weight and any split of the sums equals RMSNorm(h) within
    the run dtype's rounding (fp32: the same value up to fp32 rounding)."""
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(3, 96, generator=generator) * 3
    norm = RMSNorm(96, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=generator) + 0.5)
    sums = (h * h).reshape(3, 4, 24).sum(-1)
    finished = PendingNorm(h * norm.weight, sums, EPS).finish()
    torch.testing.assert_close(finished, norm(h), rtol=1e-6, atol=1e-6)


def test_a_quantized_layer_that_declines_finishes_a_pending_norm() -> None:
    """A quantized layer whose kernel does not take the pending factor (here: on CPU) computes
    with the finished rows."""
    generator = torch.Generator().manual_seed(1)
    h = torch.randn(2, 64, generator=generator)
    pending = PendingNorm(h * 1.5, (h * h).sum(-1, keepdim=True), EPS)
    quantized = _int4_layer(16, 64, 32, 3, "cpu")
    assert not quantized.folds_pending_norm(2, torch.float32)
    torch.testing.assert_close(quantized(pending), quantized(pending.finish()))


@pytest.mark.parametrize(("fmt", "n", "k", "group_size", "rows", "dtype", "device", "folds"), [
    ("int4", 28672, 4096, 128, 1, torch.bfloat16, "cuda", True),   # gate/up, mma.sync
    ("int4", 28672, 4096, 64, 1, torch.bfloat16, "cuda", False),   # 64-wide groups: tl.dot tiles
    ("int4", 28672, 4096, 128, 8, torch.float16, "cuda", True),    # mma.sync, 8 rows
    ("int4", 28672, 4096, 128, 40, torch.bfloat16, "cuda", False),  # past mma.sync's 32 rows
    ("int4", 6144, 4096, 128, 1, torch.bfloat16, "cuda", True),    # qkv, the one-row word kernel
    ("int4", 28672, 4096, 128, 1, torch.bfloat16, "cpu", False),   # no mma.sync off CUDA
    ("int4", 6144, 4096, 128, 1, torch.bfloat16, "cpu", True),     # the word kernel (interpreter)
    ("fp8", 28672, 4096, 4096, 1, torch.bfloat16, "cuda", True),   # gate/up, the byte kernel
    ("fp8", 6144, 4096, 4096, 1, torch.bfloat16, "cuda", True),    # qkv, mma.sync
    ("fp8", 6144, 4096, 4096, 16, torch.float16, "cuda", True),    # mma.sync, 16 rows
    ("fp8", 6144, 4096, 4096, 32, torch.bfloat16, "cuda", False),  # the byte tl.dot tiles
    ("fp8", 6144, 4096, 64, 1, torch.bfloat16, "cuda", False),     # 64-wide scale groups: word kernel
    ("fp8", 6144, 4096, 4096, 1, torch.bfloat16, "cpu", False),    # no mma.sync off CUDA: word kernel
])
def test_consumers_that_fold_a_pending_norm(fmt, n, k, group_size, rows, dtype, device, folds, monkeypatch) -> None:
    """Which next linears finish a pending norm in their kernel (so that the linear before the
    norm leaves it pending): int4's word kernel and mma.sync, fp8's mma.sync and one-row byte
    kernel, by llama3-8b's shapes, on an sm_90 device (its capability stands in for a GPU
    here)."""
    from kvserve.ops.quant.weight_only import matmul
    from kvserve.ops.quant.weight_only.matmul import folds_pending_norm

    monkeypatch.setattr(matmul, "_capability", lambda index: (9, 0))
    four_bit = fmt == "int4"
    qweight = (torch.zeros(n, k // 2, dtype=torch.uint8) if four_bit
               else torch.zeros(n, k, dtype=torch.float8_e4m3fn))
    scale = torch.ones(n, k // group_size, dtype=torch.float16 if four_bit else torch.float32)
    assert folds_pending_norm(rows, dtype, torch.device(device), qweight, scale, group_size, four_bit) is folds


# -- CUDA ------------------------------------------------------------------------------------

# llama3-8b's pairs at one row: o_proj -> gate/up and down -> qkv; int4 in groups of 128
# (word kernel -> mma.sync, word kernel -> word kernel), fp8 per channel (mma.sync -> byte
# kernel, mma.sync -> mma.sync).
GPU_CHAINS = [
    ChainCase(1, 4096, 4096, 28672, 128), ChainCase(1, 14336, 4096, 6144, 128),
    ChainCase(1, 4096, 4096, 28672, 0, producer="fp8", consumer="fp8"),
    ChainCase(1, 14336, 4096, 6144, 0, producer="fp8", consumer="fp8"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("case", GPU_CHAINS, ids=lambda case: case.id)
def test_gpu_fused_norm_chain_matches_unfused(case, dtype) -> None:
    errors = chain_errors(case, dtype, "cuda")
    assert errors["sums"] <= 1e-5
    for output in ("residual", "norm", "consumer", "consumer_after_finish"):
        assert errors[output] <= TOLERANCE[dtype], (output, errors)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "rows"), [*(("int4", rows) for rows in (2, 5, 8, 16, 32)),
                                           *(("fp8", rows) for rows in (2, 5, 8, 16))])
def test_gpu_mma_kernel_finishes_pending_rows(fmt, rows) -> None:
    """mma.sync with 1-4 x tiles scales each row by its own factor (sums made by torch)."""
    generator = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 4096, generator=generator) * (1 + torch.arange(rows)[:, None])).bfloat16().cuda()
    weight = (1 + torch.randn(4096, generator=generator) * 0.1).bfloat16().cuda()
    int4 = fmt == "int4"  # int4 in groups of 128, fp8 per channel
    layer = _layer(fmt, 28672 if int4 else 6144, 4096, 128 if int4 else 0, 4, "cuda")
    sums = h.float().pow(2).reshape(rows, 32, 128).sum(-1)
    rows_in = (h.float() * weight.float()).bfloat16()
    y = weight_only_matmul(rows_in, **_stored(layer), pending=PendingNorm(rows_in, sums, EPS))
    assert y is not None
    normed = RMSNorm(4096, EPS).cuda().bfloat16()
    with torch.no_grad():
        normed.weight.copy_(weight)
    expected = normed._norm(h).double() @ _weight(layer).T.cuda()
    assert _relative(y, expected) <= TOLERANCE[torch.bfloat16]
