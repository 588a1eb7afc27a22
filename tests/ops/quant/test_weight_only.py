"""The Triton weight-only matmul (W8A16, W4A16, fp8 weights) against an fp64 product of
the layers' own dequantized weights, and the per-token fp8 activation quantization
against torch's rounding.

Without a GPU the kernel runs under Triton's interpreter on small odd shapes, all in one
subprocess (tests/triton_interpreter.py); on CUDA the layers run it on real shapes
(marked gpu), through their apply() and inside a captured CUDA graph."""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from torch import nn

from kvserve.ops.quant.fp8_activation import quantize_per_token
from kvserve.ops.quant.weight_only import LaunchConfig, unpack_weight, weight_only_matmul
from kvserve.ops.quant.weight_only.matmul import split_k
from kvserve.ops.quant.weight_only.tiles import split_tiles
from kvserve.quantization import base
from kvserve.quantization.fp8 import Fp8Linear, quantize_fp8
from kvserve.quantization.int4 import Int4Linear, dequantize_int4, quantize_int4
from kvserve.quantization.int8 import GroupInt8Linear, Int8Linear
from tests.fp8_reference import per_token_reference
from tests.triton_interpreter import run_interpreted, slow_tests_selected

# Worst relative error ||y - ref|| / ||ref|| per row against fp64 on the same weights.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _float_linear(n: int, k: int, seed: int, device: str = "cpu") -> nn.Linear:
    generator = torch.Generator(device).manual_seed(seed)
    layer = nn.Linear(k, n, bias=False, device=device)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=generator, device=device) * 0.05)
    return layer


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
        scale = torch.rand(n, k // 32, generator=torch.Generator(device).manual_seed(seed), device=device) / 100
        return Fp8Linear(q, scale, None)
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


def per_token_matches(x: torch.Tensor) -> bool:
    (q, scale), (ref_q, ref_scale) = quantize_per_token(x), per_token_reference(x)
    return torch.equal(scale.cpu(), ref_scale) and torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))


def relative_error(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    expected = x.double() @ weight.double().T
    return ((y.double() - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()


# -- small cases for the interpreter --------------------------------------------------------

# (kind, rows, out features, in features, forced split-K, the one-row CUDA-core kernel
# (True) or tl.dot tiles (None)): odd N everywhere, odd K for the per-channel forms, rows
# around the 16-row tile.
SMALL_CASES = [
    ("int8", 1, 37, 51, None, None), ("int8", 17, 70, 160, 3, None), ("int8", 5, 33, 300, None, None),
    ("int8", 1, 37, 51, 2, True), ("int8", 3, 70, 160, None, True),
    ("group_int8", 3, 45, 96, 2, None), ("group_int8", 16, 19, 64, None, None), ("group_int8", 1, 45, 96, 2, True),
    ("int4", 1, 70, 160, None, None), ("int4", 7, 37, 96, 3, None), ("int4", 18, 33, 64, None, None),
    ("int4", 1, 70, 160, 3, True), ("int4", 3, 37, 96, None, True),
    ("fp8", 1, 37, 51, None, None), ("fp8", 9, 70, 160, 2, None), ("fp8_group", 2, 45, 96, 3, None),
    ("fp8", 1, 37, 51, 2, True), ("fp8_group", 2, 45, 96, None, True),
]
SMALL_DTYPES = (torch.float32, torch.bfloat16)
PER_TOKEN_SHAPES = ((3, 77), (2, 128))


class WordsCase(NamedTuple):
    """A call of the int4 int32-word kernels: `config` None takes default_config; variant
    "unaligned" hands x as a view at an odd element offset (bf16 pairs cannot load as one
    int32), "no_offset" drops the minimums (W = q * scale), "fp16_scales" passes scales and
    minimums in fp16 (as Int4Linear stores them on CUDA), "even_splits" spreads K's tiles
    over the splits as evenly as they go (LaunchConfig.even_splits)."""
    kernel: str | None
    rows: int
    n: int
    k: int
    group_size: int | None  # None: per-channel scales (fp8)
    config: tuple[int, int, int, int | None] | None = None  # block_m, block_n, block_k, split
    variant: str = ""

    @property
    def id(self) -> str:
        config = "default" if self.config is None else "x".join(map(str, self.config))
        return f"words-{self.kernel}-m{self.rows}-n{self.n}-k{self.k}-g{self.group_size}-{config}-{self.variant}"


# Odd N, group sizes 32 / 64 / 128 (block_k is halved down to the group, or for "fma" is
# kept where it is two groups), groups of one and of two tiles and tiles of two groups,
# rows 1..40 with several row blocks, split-K with uneven splits (summed in the kernel),
# the defaults.
WORDS_CASES = [
    WordsCase("fma", 1, 37, 256, 32, (1, 16, 64, 3)),
    WordsCase("fma", 3, 33, 512, 64, (2, 16, 128, 2)),
    WordsCase("fma", 2, 19, 256, 128, (1, 16, 256, None)),
    WordsCase("fma", 1, 37, 512, 128, (1, 32, 256, 2), "unaligned"),
    WordsCase("fma", 2, 21, 512, 128, (1, 16, 256, 2), "no_offset"),
    WordsCase("fma", 1, 37, 384, 128, (1, 16, 256, 2)),  # K is not whole two-group tiles
    WordsCase("fma", 1, 37, 128, 32, (1, 16, 128, None)),
    WordsCase("fma", 1, 45, 256, 64, (1, 32, 64, 3)),
    WordsCase("fma", 2, 33, 256, 128, (2, 16, 64, 2)),
    WordsCase("fma", 3, 19, 384, 128, (4, 16, 128, 3)),
    WordsCase("fma", 5, 37, 256, 64, (2, 32, 32, 4)),
    WordsCase("fma", 16, 21, 128, 32, (16, 16, 32, None)),
    WordsCase("fma", 3, 37, 256, 64, (4, 16, 64, 2), "unaligned"),
    WordsCase("fma", 2, 33, 256, 128, (2, 16, 128, 2), "no_offset"),
    WordsCase("fma", 1, 37, 512, 128, (1, 32, 256, 2), "fp16_scales"),
    WordsCase("fma", 3, 19, 384, 64, (4, 16, 64, 3), "fp16_scales"),
    # 16 tiles in 6 splits: runs of 3, 3, 3, 3, 3, 1, and as even splits 3, 3, 3, 3, 2, 2.
    WordsCase("fma", 1, 37, 512, 32, (1, 16, 32, 6)),
    WordsCase("fma", 1, 37, 512, 32, (1, 16, 32, 6), "even_splits"),
    # 32 tiles in 11 splits: the last split sums their partials 8 at a time (summed_splits).
    WordsCase("fma", 1, 37, 1024, 32, (1, 16, 32, 11)),
    WordsCase("dot", 1, 37, 128, 32, (16, 16, 32, None)),
    WordsCase("dot", 2, 45, 256, 64, (16, 32, 32, 3)),
    WordsCase("dot", 3, 33, 384, 128, (16, 16, 128, 3)),
    WordsCase("dot", 5, 70, 256, 128, (16, 64, 64, 2)),
    WordsCase("dot", 16, 19, 256, 64, (16, 16, 64, 4)),
    WordsCase("dot", 17, 37, 128, 128, (16, 16, 128, 2)),
    WordsCase("dot", 2, 33, 256, 128, (16, 16, 128, 2), "no_offset"),
    WordsCase("dot", 5, 70, 256, 128, (16, 64, 64, 2), "fp16_scales"),
    WordsCase(None, 1, 37, 256, 128), WordsCase(None, 4, 37, 256, 128), WordsCase(None, 16, 37, 256, 128),
    WordsCase(None, 40, 37, 256, 128),
]
WORDS_DTYPES = (torch.bfloat16, torch.float16)
# The word kernels' float16 cases take the bfloat16 ones' code path: slow-marked (half this
# module's interpreter time), run with -m slow.
SLOW_DTYPES = (torch.float16,)


def dtype_params(dtypes: tuple[torch.dtype, ...]) -> list:
    return [pytest.param(dtype, marks=pytest.mark.slow) if dtype in SLOW_DTYPES else dtype for dtype in dtypes]


class Fp8WordsCase(WordsCase):
    """A call of the fp8 int32-word kernels: group_size None is per-channel scales;
    `config` None takes default_config (odd K then falls back to the byte kernels);
    variants "unaligned" and "even_splits" as for WordsCase."""

    __slots__ = ()

    @property
    def id(self) -> str:
        return f"fp8-{super().id}"


# Odd N, per-channel and grouped scales (block_k halved down to the group), rows 1..17 with
# several row blocks, split-K with uneven splits (summed in the kernel), the defaults.
FP8_WORDS_CASES = [
    Fp8WordsCase("fma", 1, 37, 320, None, (1, 16, 64, 3)),
    Fp8WordsCase("fma", 1, 45, 256, 64, (1, 32, 128, 2)),
    Fp8WordsCase("fma", 1, 37, 512, None, (1, 16, 32, 6), "even_splits"),
    Fp8WordsCase("fma", 1, 37, 1024, None, (1, 16, 32, 11), "even_splits"),
    Fp8WordsCase("fma", 3, 33, 384, 128, (4, 16, 128, 3)),
    Fp8WordsCase("fma", 16, 21, 128, None, (16, 16, 32, None)),
    Fp8WordsCase("fma", 5, 37, 192, 32, (2, 32, 32, 4), "unaligned"),
    Fp8WordsCase("dot", 1, 37, 320, None, (16, 16, 64, 3)),
    Fp8WordsCase("dot", 2, 45, 256, 64, (16, 32, 32, 3)),
    Fp8WordsCase("dot", 16, 19, 384, 128, (16, 16, 128, 2)),
    Fp8WordsCase("dot", 11, 70, 256, None, (16, 64, 64, 2)),
    Fp8WordsCase("dot", 17, 37, 128, None, (16, 16, 32, None)),
    Fp8WordsCase(None, 1, 37, 512, None), Fp8WordsCase(None, 4, 37, 256, 32), Fp8WordsCase(None, 16, 37, 256, None),
    Fp8WordsCase(None, 2, 37, 250, None),
]
# Every finite e4m3 code (subnormals, zeros, +-448) at every byte position of a word, read
# by (kernel, block_m, split) against one-hot rows of x: the output must be exact.
E4M3_CODES = torch.tensor([c for c in range(256) if c & 127 != 127], dtype=torch.uint8)
FP8_EXACT_CASES = (("fma", 16, 2), ("dot", 16, 2), ("fma", 4, None))


def _case_id(case: tuple, dtype: torch.dtype) -> str:
    kind, m, n, k, split, gemv = case
    product = "dot" if gemv is None else "gemv"
    return f"{kind}-m{m}-n{n}-k{k}-split{split}-{product}-{str(dtype).removeprefix('torch.')}"


def _words_inputs(case: WordsCase, dtype: torch.dtype) -> tuple[torch.Tensor, LaunchConfig | None]:
    """A word-kernel case's activations (strided by one element for "unaligned") and its
    launch config (None: the kernel's default table)."""
    generator = torch.Generator().manual_seed(case.k)
    x = torch.randn(case.rows, case.k + 1, generator=generator).to(dtype)
    x = x[:, 1:] if case.variant == "unaligned" else x[:, :-1].contiguous()
    config = None
    if case.config is not None:
        block_m, block_n, block_k, split = case.config
        config = LaunchConfig(block_m, block_n, block_k, split_k=split, words=case.kernel,
                              even_splits=case.variant == "even_splits")
    return x, config


def words_case_error(case: WordsCase, dtype: torch.dtype) -> float:
    layer = _float_linear(case.n, case.k, seed=case.rows)
    q, scale, minimum = quantize_int4(layer.weight.detach(), case.group_size)
    if case.variant == "fp16_scales":
        scale, minimum = scale.half(), minimum.half()
    offset = None if case.variant == "no_offset" else minimum
    x, config = _words_inputs(case, dtype)
    packed = Int4Linear(q, scale, minimum, case.group_size, None)
    assert not packed.kernel_layout
    qweight = packed.qweight.view(case.n, case.k // 2)
    y = weight_only_matmul(x, qweight, scale, offset, case.group_size, four_bit=True, config=config)
    assert y.dtype == dtype and y.shape == (case.rows, case.n)
    weight = dequantize_int4(q, scale, minimum if offset is not None else torch.zeros_like(minimum))
    return relative_error(y, x, weight.double())


def fp8_words_case_error(case: Fp8WordsCase, dtype: torch.dtype) -> float:
    layer = make_layer("fp8", case.n, case.k, seed=case.rows)
    scale = layer.scale
    if case.group_size is not None:
        generator = torch.Generator().manual_seed(case.n)
        scale = torch.rand(case.n, case.k // case.group_size, generator=generator) / 100
    x, config = _words_inputs(case, dtype)
    y = weight_only_matmul(x, layer.qweight, scale, None, case.group_size or case.k, config=config)
    assert y.dtype == dtype and y.shape == (case.rows, case.n)
    groups = layer.qweight.double().reshape(case.n, scale.shape[1], -1) * scale.double()[..., None]
    return relative_error(y, x, groups.reshape(case.n, case.k))


def fp8_codes_exact(kernel: str, block_m: int, split: int | None, dtype: torch.dtype, grouped: bool) -> bool:
    """W[n, k] runs through all e4m3 codes; row r of x picks k = 4 r + r % 4 (each byte
    position of a word), so y[r] = W[:, k] * scale exactly (power-of-two scales)."""
    n, k, rows = len(E4M3_CODES), 64, 16
    codes = E4M3_CODES[(torch.arange(n)[:, None] + 7 * torch.arange(k)[None, :]) % n]
    qweight = codes.view(torch.float8_e4m3fn)
    scale = 2.0 ** (torch.arange(n * (2 if grouped else 1)) % 5 - 2.0).reshape(n, -1)
    picked = 4 * torch.arange(rows) + torch.arange(rows) % 4
    x = torch.zeros(rows, k, dtype=dtype)
    x[torch.arange(rows), picked] = 1
    config = LaunchConfig(block_m, 32, 32, split_k=split, words=kernel)
    y = weight_only_matmul(x, qweight, scale, None, k // scale.shape[1], config=config)
    weight = qweight.float().reshape(n, scale.shape[1], -1) * scale[..., None]
    return torch.equal(y, weight.reshape(n, k)[:, picked].T.to(dtype))


def run_small_cases(with_slow: bool = True) -> None:
    """Subprocess entry: print {case id: relative error} as JSON (without SLOW_DTYPES'
    cases unless `with_slow`)."""
    results = {}
    words_dtypes = [dtype for dtype in WORDS_DTYPES if with_slow or dtype not in SLOW_DTYPES]
    for dtype in words_dtypes:
        dtype_name = str(dtype).removeprefix("torch.")
        for case in FP8_WORDS_CASES:
            results[f"{case.id}-{dtype_name}"] = fp8_words_case_error(case, dtype)
        for kernel, block_m, split in FP8_EXACT_CASES:
            for grouped in (False, True):
                results[f"fp8-codes-{kernel}-{block_m}-{split}-{grouped}-{dtype_name}"] = fp8_codes_exact(
                    kernel, block_m, split, dtype, grouped)
    for case in WORDS_CASES:
        for dtype in words_dtypes:
            results[f"{case.id}-{str(dtype).removeprefix('torch.')}"] = words_case_error(case, dtype)
    for case in SMALL_CASES:
        kind, m, n, k, split, gemv = case
        layer = make_layer(kind, n, k)
        for dtype in SMALL_DTYPES:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            config = LaunchConfig(16 if gemv is None else 1, 32, 64, split_k=split)
            y = weight_only_matmul(x, *kernel_args(layer), config=config)
            assert y.dtype == dtype and y.shape == (m, n)
            results[_case_id(case, dtype)] = relative_error(y, x, layer.dequantize(torch.float64))
    for num_tiles, splits, even in SPLIT_TILES_CASES:
        results[f"split-tiles-{num_tiles}-{splits}-{even}"] = split_tile_ranges(num_tiles, splits, even)
    for m, k in PER_TOKEN_SHAPES:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) * 3
        x[0] = 0  # an all-zero row keeps a finite scale
        results[f"per_token-m{m}-k{k}"] = per_token_matches(x)
    for kind in UNPACK_KINDS:
        for n, k, group_size in UNPACK_SHAPES:
            results[f"unpack-{kind}-{n}x{k}-g{group_size}"] = unpack_error(kind, n, k, group_size, "cpu")
    print(json.dumps(results))


# (N, K, group size): groups of 32-128, rows longer and shorter than a program's 512 bytes,
# a last program with a partial run of groups, odd N.
UNPACK_SHAPES = [(37, 96, 32), (5, 1536, 128), (3, 1088, 64), (8, 128, 128)]


# What unpack_weight reads: int4 nibble pairs with float offsets in fp32 and fp16 (Int4Linear
# on CUDA), int8 bytes with and without offsets (GroupInt8Linear: GGUF Q5_K/Q6_K and 8-bit
# GPTQ; Q8_0).
UNPACK_KINDS = ("int4", "int4-fp16", "int8-offset", "int8")


def unpack_error(kind: str, n: int, k: int, group_size: int, device: str) -> str | None:
    """unpack_weight against the layer's torch dequantization (dequantize_int4, or
    GroupInt8Linear.dequantize) of the same stored values: fp32 within an fp32 rounding of
    each value, and the bf16 output exactly that fp32 value rounded once. None if so, else
    what differs."""
    generator = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=generator).to(device)
    four_bit = kind.startswith("int4")
    if four_bit:
        q, scale, offset = quantize_int4(weight, group_size)
        if kind == "int4-fp16":
            scale, offset = scale.half(), offset.half()
        stored = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # k = 2 j low, 2 j + 1 high
        reference = dequantize_int4(q, scale, offset)
    else:
        stored = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8).to(device)
        scale = torch.rand(n, k // group_size, generator=generator).to(device) / 64
        offset = -torch.rand(n, k // group_size, generator=generator).to(device) if kind == "int8-offset" else None
        reference = GroupInt8Linear(stored, scale, offset, group_size, None).dequantize(torch.float32)
    fp32 = unpack_weight(stored, scale, offset, group_size, torch.float32, four_bit=four_bit)
    bf16 = unpack_weight(stored, scale, offset, group_size, torch.bfloat16, four_bit=four_bit)
    slack = 2 * torch.finfo(torch.float32).eps * reference.abs().max()
    if fp32.shape != (n, k) or (fp32 - reference).abs().max() > slack:
        return f"fp32 differs by {(fp32 - reference).abs().max().item():.3e}"
    if not torch.equal(bf16, fp32.to(torch.bfloat16)):
        return "bf16 is not the fp32 value rounded once"
    return None


# (K tiles, splits, even_splits): llama3-8b's fp8 down at one row on an H100 (112 in 23),
# int4's qkv (16 in 6), and others uneven and even.
SPLIT_TILES_CASES = [(tiles, splits, even) for tiles, splits in ((112, 23), (16, 6), (5, 3), (7, 7), (8, 4), (3, 1))
                     for even in (False, True)]


@triton.jit
def _split_tiles_kernel(out_ptr, num_tiles, tiles_per_split, EVEN_SPLITS: tl.constexpr):
    first, last = split_tiles(num_tiles, tiles_per_split, EVEN_SPLITS)
    tl.store(out_ptr + 2 * tl.program_id(2), first)
    tl.store(out_ptr + 2 * tl.program_id(2) + 1, last)


def split_tile_ranges(num_tiles: int, splits: int, even: bool) -> list[list[int]]:
    """Each split's [first, last) K tiles as split_tiles gives them (grid axis 2), for the
    splits split_k makes of a fixed split_k."""
    splits, tiles_per_split = split_k(LaunchConfig(1, 16, 32, split_k=splits), num_tiles, 1, torch.device("cpu"))
    out = torch.full((splits, 2), -1, dtype=torch.int32)
    _split_tiles_kernel[(1, 1, splits)](out, num_tiles, tiles_per_split, EVEN_SPLITS=even)
    return out.tolist()


@pytest.fixture(scope="module")
def interpreted_errors(request) -> dict[str, float | bool]:
    pytest.importorskip("triton")
    return json.loads(run_interpreted("tests.ops.quant.test_weight_only", "run_small_cases",
                                      slow_tests_selected(request)))


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: _case_id(c, torch.float32).rsplit("-", 1)[0])
def test_interpreted_matches_reference(case, dtype, interpreted_errors) -> None:
    assert interpreted_errors[_case_id(case, dtype)] <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", dtype_params(WORDS_DTYPES), ids=str)
@pytest.mark.parametrize("case", WORDS_CASES, ids=lambda c: c.id)
def test_interpreted_int4_word_kernels_match_reference(case, dtype, interpreted_errors) -> None:
    assert interpreted_errors[f"{case.id}-{str(dtype).removeprefix('torch.')}"] <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", dtype_params(WORDS_DTYPES), ids=str)
@pytest.mark.parametrize("case", FP8_WORDS_CASES, ids=lambda c: c.id)
def test_interpreted_fp8_word_kernels_match_reference(case, dtype, interpreted_errors) -> None:
    assert interpreted_errors[f"{case.id}-{str(dtype).removeprefix('torch.')}"] <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", dtype_params(WORDS_DTYPES), ids=str)
@pytest.mark.parametrize("grouped", (False, True), ids=("per_channel", "grouped"))
@pytest.mark.parametrize("case", FP8_EXACT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_interpreted_fp8_word_kernels_read_every_e4m3_code_exactly(case, grouped, dtype, interpreted_errors) -> None:
    kernel, block_m, split = case
    assert interpreted_errors[f"fp8-codes-{kernel}-{block_m}-{split}-{grouped}-{str(dtype).removeprefix('torch.')}"]


@pytest.mark.parametrize("case", SPLIT_TILES_CASES, ids=lambda c: "{}-tiles-{}-splits-even{}".format(*c))
def test_interpreted_splits_cover_k_in_the_chosen_runs(case, interpreted_errors) -> None:
    """Consecutive runs covering every tile once: as even as they go, longer runs first (as
    numpy's array_split), or runs of ceil(tiles / splits) with the remainder last."""
    num_tiles, splits, even = case
    if even:
        runs = [(int(run[0]), int(run[-1]) + 1) for run in np.array_split(np.arange(num_tiles), splits)]
    else:
        size = -(-num_tiles // splits)
        runs = [(first, min(first + size, num_tiles)) for first in range(0, num_tiles, size)]
    assert interpreted_errors[f"split-tiles-{num_tiles}-{splits}-{even}"] == [list(run) for run in runs]


@pytest.mark.parametrize("kind", UNPACK_KINDS)
@pytest.mark.parametrize("shape", UNPACK_SHAPES, ids=lambda s: "{}x{}-g{}".format(*s))
def test_interpreted_unpack_matches_dequantize(shape, kind, interpreted_errors) -> None:
    n, k, group_size = shape
    assert interpreted_errors[f"unpack-{kind}-{n}x{k}-g{group_size}"] is None


def test_unpack_declines_groups_it_cannot_tile() -> None:
    scales = torch.ones(4, 1)
    packed = torch.zeros(4, 48, dtype=torch.uint8)
    assert unpack_weight(packed, scales, scales, 96, torch.float32, four_bit=True) is None  # not a power of two
    assert unpack_weight(torch.zeros(4, 96, dtype=torch.int8), scales, None, 96, torch.float32, four_bit=False) is None


@pytest.mark.parametrize("shape", PER_TOKEN_SHAPES, ids=str)
def test_interpreted_per_token_fp8_matches_torch(shape, interpreted_errors) -> None:
    assert interpreted_errors[f"per_token-m{shape[0]}-k{shape[1]}"] is True


def test_kernel_declines_what_it_cannot_tile() -> None:
    layer = make_layer("int8", 16, 64)
    x = torch.randn(1, 64)
    # Groups narrower than 16 elements, and 4-bit rows of odd length, go the dense path.
    assert weight_only_matmul(x, layer.qweight, torch.ones(16, 8), None, 8) is None
    assert weight_only_matmul(torch.randn(1, 63), torch.zeros(16, 32, dtype=torch.uint8),
                              torch.ones(16, 1), None, 63, four_bit=True) is None


def test_row_counts_pick_the_kernels_the_sweeps_chose() -> None:
    """default_config's routing (`kvserve bench quantized-linears --sweep`): 4-bit weights on
    the CUDA cores at one row but on mma.sync for wide linears and for 2-32 rows, tl.dot
    tiles above; fp8 on mma.sync for 1-16 rows but the byte kernel for one row of a wide
    linear (the byte kernel's tiles above 16 rows); and the mma kernels only where they
    apply (CUDA, groups of whole 128s, up to 64 rows), else the tiles the rows take without
    them."""
    from kvserve.ops.quant.weight_only import configs as tk
    from kvserve.ops.quant.weight_only.matmul import mma_applies

    words = {(rows, n): tk.default_config(rows, True, False, n).words for rows in (1, 2, 8, 9, 32, 33, 64)
             for n in (4096, 28672)}
    assert words == {(1, 4096): "fma", (1, 28672): "mma", (2, 4096): "mma", (2, 28672): "mma", (8, 4096): "mma",
                     (8, 28672): "mma", (9, 4096): "mma", (9, 28672): "mma", (32, 4096): "mma",
                     (32, 28672): "mma", (33, 4096): "dot", (33, 28672): "dot", (64, 4096): "dot", (64, 28672): "dot"}
    assert [tk.default_config(rows, True, False, 28672, mma=False).block_m for rows in (1, 8, 16, 17, 64)] == [
        16, 16, 16, 64, 64]
    # 4-bit at 9-16 rows: the wide gate/up on its own mma.sync config (two x tiles), the
    # narrow linears on theirs; at 8 and 17 rows both take the same one.
    for rows in (9, 12, 16):
        assert tk.default_config(rows, True, False, 28672) == tk.INT4_WIDE_TWO_TILES_CONFIG
        narrow = tk.default_config(rows, True, False, 14336)
        assert (narrow.block_n, narrow.num_warps) == (64, 4) and tk.default_config(rows, True, False, 4096) == narrow
    for rows in (8, 17):
        assert tk.default_config(rows, True, False, 28672) == tk.default_config(rows, True, False, 4096)
    assert [tk.default_config(rows, False, True, 4096).words for rows in (1, 4, 8, 16, 17)] == [
        "mma", "mma", "mma", "mma", None]
    # One row against a wide fp8 weight: the byte kernel; without mma.sync, the word kernel.
    assert tk.default_config(1, False, True, 28672) == tk.FP8_WIDE_ONE_ROW_CONFIG
    # int8 against a wide weight (an LM head) at decode rows: tl.dot tiles 256 k deep.
    assert {tk.default_config(rows, False, False, 128256) for rows in (1, 4, 16)} == {tk.INT8_WIDE_CONFIG}
    assert tk.default_config(17, False, False, 128256) != tk.INT8_WIDE_CONFIG
    assert tk.default_config(1, False, True, 4096, mma=False).words == "fma"
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    assert not mma_applies(x, 128, True, 256)  # not CUDA
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        x = x.cuda()
        assert mma_applies(x, 128, True, 256) and mma_applies(x, 512, False, 256)
        assert not mma_applies(x, 64, True, 256)  # 64-wide groups (GGUF, GPTQ/AWQ files)
        assert not mma_applies(x[:, :500], 128, True, 256)  # K not whole tiles
        assert mma_applies(torch.randn(32, 512, device="cuda", dtype=torch.bfloat16), 128, True, 256)
        assert not mma_applies(torch.randn(33, 512, device="cuda", dtype=torch.bfloat16), 128, True, 256)


# -- real shapes on the GPU -----------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_KINDS = ("int8", "group_int8", "int4", "fp8", "fp8_group")
# llama3-8b's linears (gate/up fused as kvserve runs them), and odd ones (K % 128 != 0).
GPU_SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096), (14336, 4096),
              (4000, 4160), (37, 96)]
GPU_ROWS = (1, 3, 8, 12, 16, 24, 33, 64, 65, 200)


@pytest.mark.gpu
@requires_cuda
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
            # fp8 activations cost about 2**-4 per element: the W8A8 kernel's rows (2-128 on
            # Hopper) and _scaled_mm on bf16 prefill rows quantize x per token.
            fp8_activations = kind == "fp8" and (
                layer.takes_fp8_rows(m, dtype) or (m > base.GPU_KERNEL_MAX_ROWS and dtype == torch.bfloat16)
            )
            tolerance = 6e-2 if fp8_activations else TOLERANCE[dtype]
            assert error <= tolerance, f"{kind} {(m, n, k)} {dtype}: relative error {error:.2e}"


@pytest.mark.gpu
@requires_cuda
def test_gpu_int4_layers_store_fp16_scales_where_fp16_holds_them() -> None:
    weight = torch.randn(64, 256, device="cuda") / 10
    layer = Int4Linear(*quantize_int4(weight, 128), 128, None)
    moved = Int4Linear(*quantize_int4(weight.cpu(), 128), 128, None).cuda()
    assert layer.scale.dtype == layer.minimum.dtype == moved.scale.dtype == moved.minimum.dtype == torch.float16
    assert torch.equal(moved.dequantize(), layer.dequantize())
    x = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    assert relative_error(layer(x), x, layer.dequantize(torch.float64)) <= TOLERANCE[torch.bfloat16]
    tiny = Int4Linear(*quantize_int4(weight * 1e-4, 128), 128, None)  # scales below fp16's normal range
    assert tiny.scale.dtype == torch.float32


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", [(28672, 4096, 128), (4096, 14336, 128), (4000, 4160, 64), (37, 96, 32)],
                         ids=lambda s: "{}x{}-g{}".format(*s))
@pytest.mark.parametrize("kind", UNPACK_KINDS)
def test_gpu_unpack_matches_dequantize(shape, kind) -> None:
    assert unpack_error(kind, *shape, "cuda") is None


def _sweep_layers(fmt: str, n: int, k: int) -> list:
    """The stored forms `bench quantized-linears` sweeps (and fp8 in 128-wide groups)."""
    weight = _float_linear(n, k, 0, "cuda").weight.detach()
    if fmt == "int4":
        return [Int4Linear(*quantize_int4(weight, 128), 128, None)]
    q, scale = quantize_fp8(weight)
    blocks = torch.rand(n, k // 128, device="cuda") / 100
    return [Fp8Linear(q, scale[:, None], None), Fp8Linear(q, blocks, None)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("fmt", "rows"), [("int4", 1), ("int4", 4), ("int4", 8), ("int4", 16), ("int4", 32),
                                           ("int4", 64), ("fp8-triton", 1), ("fp8-triton", 4), ("fp8-triton", 8),
                                           ("fp8-triton", 16), ("fp8-triton", 32), ("fp8-triton", 64)])
def test_gpu_sweep_configs_match_reference(fmt, rows) -> None:
    """Every config `bench quantized-linears --sweep` times is right on llama3-8b's shapes
    and an odd one, and the in-kernel split-K sum is deterministic."""
    from kvserve.benchmarks.quantized_linears import SWEEP_CONFIGS

    if fmt.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    for n, k in ((4096, 14336), (37, 384)):
        for layer in _sweep_layers(fmt, n, k):
            weight = layer.dequantize(torch.float64)
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(rows, k, device="cuda").to(dtype)
                for config in SWEEP_CONFIGS[fmt][rows]:
                    y = weight_only_matmul(x, *kernel_args(layer), config=config)
                    error = relative_error(y, x, weight)
                    assert error <= TOLERANCE[dtype], f"{config} {(rows, n, k)} {dtype}: relative error {error:.2e}"
                    assert torch.equal(y, weight_only_matmul(x, *kernel_args(layer), config=config)), config


# (split_k, even_splits) of the mma kernels' GPU tests: one split and the default's for every
# case; the default's even and 6 fixed both ways (16 or 32 K tiles: a short last split, or
# runs of 3 and 2, 6 and 5) where K has 2048 or more (fewer compiles on a cold cache).
SPLIT_LAYOUTS = ((1, False), (None, False), (None, True), (6, False), (6, True))


def split_layouts(k: int) -> tuple[tuple[int | None, bool], ...]:
    return SPLIT_LAYOUTS if k >= 2048 else SPLIT_LAYOUTS[:2]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_gpu_int4_mma_kernel_matches_reference(dtype) -> None:
    """The mma.sync kernel at every row count of one x tile and across 2-4 tiles (9-32 rows),
    with and without offsets, 128- and 256-wide groups and one group a row, weight rows that
    are not whole warp tiles, one split and several (SPLIT_LAYOUTS): against the fp64
    dequantized weight, and deterministic."""
    cases = [(m, 200, 512, 128, True, 128, 4) for m in (*range(1, 10), 15, 16, 17, 31, 32)] + [
        (8, 96, 1024, 256, False, 128, 4), (5, 1000, 2048, 2048, True, 256, 8), (2, 37, 256, 128, True, 64, 2),
        (1, 4096, 4096, 128, True, 64, 4), (4, 14336, 4096, 128, True, 128, 4), (24, 96, 1024, 256, False, 64, 4),
        (28, 1000, 2048, 2048, True, 32, 2), (32, 14336, 4096, 128, True, 64, 4), (12, 4096, 4096, 128, True, 64, 4),
        (9, 2000, 1024, 128, True, 128, 2),
    ]
    for m, n, k, group, has_offset, block_n, warps in cases:
        weight = _float_linear(n, k, 0, "cuda").weight.detach()
        q, scale, offset = quantize_int4(weight, group)
        if not has_offset:
            offset = torch.zeros_like(scale)
        reference = dequantize_int4(q, scale, offset)
        qweight = q[:, 0::2] | (q[:, 1::2] << 4)  # low nibble: even k
        offset = offset if has_offset else None
        x = torch.randn(m, k, device="cuda").to(dtype)
        for split, even in split_layouts(k):
            config = LaunchConfig(8, block_n, 256, num_warps=warps, num_stages=1, split_k=split, words="mma",
                                  even_splits=even)
            y = weight_only_matmul(x, qweight, scale, offset, group, four_bit=True, config=config)
            error = relative_error(y, x, reference)
            assert error <= TOLERANCE[dtype], f"{(m, n, k, group, has_offset, block_n, split)}: {error:.2e}"
            again = weight_only_matmul(x, qweight, scale, offset, group, four_bit=True, config=config)
            assert torch.equal(y, again)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_gpu_fp8_mma_kernel_matches_reference(dtype) -> None:
    """The fp8 mma.sync kernel at every row count of one x tile and across 2-4 tiles (9-32
    rows), per-channel and 128-wide group scales, weight rows that are not whole warp tiles,
    one split and several (SPLIT_LAYOUTS): against the fp64 dequantized weight, and
    deterministic; every finite e4m3 code read exactly."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    cases = [(m, 200, 512, 0, 128, 4) for m in (*range(1, 10), 15, 16, 17, 31, 32)] + [
        (8, 96, 1024, 128, 128, 4), (5, 1000, 2048, 128, 256, 8), (2, 37, 128, 0, 64, 2), (4, 14336, 4096, 0, 128, 4),
        (24, 96, 1024, 128, 64, 4), (28, 1000, 2048, 0, 32, 2), (32, 14336, 4096, 0, 64, 4),
    ]
    for m, n, k, group, block_n, warps in cases:
        weight = _float_linear(n, k, 0, "cuda").weight.detach()
        q, scale = quantize_fp8(weight)
        scale = scale[:, None] if group == 0 else torch.rand(n, k // group, device="cuda") / 100
        layer = Fp8Linear(q, scale, None)
        reference = layer.dequantize(torch.float64)
        x = torch.randn(m, k, device="cuda").to(dtype)
        for split, even in split_layouts(k):
            config = LaunchConfig(8, block_n, 128, num_warps=warps, num_stages=1, split_k=split, words="mma",
                                  even_splits=even)
            y = weight_only_matmul(x, *kernel_args(layer)[:4], config=config)
            error = relative_error(y, x, reference)
            assert error <= TOLERANCE[dtype], f"{(m, n, k, group, block_n, split)}: {error:.2e}"
            assert torch.equal(y, weight_only_matmul(x, *kernel_args(layer)[:4], config=config))
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
    qweight = codes[:, None].expand(256, 128).contiguous().view(torch.float8_e4m3fn)
    for rows in (8, 32):  # x row i picks weight column 2 i
        x = torch.zeros(rows, 128, device="cuda", dtype=dtype)
        x[torch.arange(rows), torch.arange(rows) * 2] = 1.0
        y = weight_only_matmul(x, qweight, torch.ones(256, 1, device="cuda"), None, 128,
                               config=LaunchConfig(rows, 128, 128, num_warps=4, num_stages=1, words="mma"))
        assert torch.equal(y.float(), qweight.float().T[: 2 * rows : 2].to(dtype).float())


@pytest.mark.gpu
@requires_cuda
def test_gpu_per_token_fp8_matches_torch() -> None:
    for m, k in ((1, 4096), (300, 14336), (7, 77)):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16) * 3
        assert per_token_matches(x), (m, k)


@pytest.mark.gpu
@requires_cuda
def test_gpu_scaled_mm_accumulates_the_fp8_operands_closely() -> None:
    """_scaled_mm (fast accumulation) against the fp64 product of the very fp8 operands it
    multiplies: the error of accumulating, not of quantizing (that one is ~4e-2)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    for m, n, k in ((96, 6144, 4096), (256, 4096, 14336), (80, 48, 96)):
        layer = make_layer("fp8", n, k, device="cuda")
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        assert layer._scaled_mm_applies(x)
        x_fp8, x_scale = quantize_per_token(x)
        reference = (x_fp8.double() * x_scale.double()) @ layer.dequantize(torch.float64).t()
        error = (layer._scaled_mm(x).double() - reference).abs().max() / reference.abs().max()
        assert error <= 1.5e-2, f"{(m, n, k)}: {error:.2e}"


@pytest.mark.gpu
@requires_cuda
def test_gpu_int4_checkpoint_layout_is_repacked_on_the_device() -> None:
    layer = make_layer("int4", 128, 256)  # built on the CPU in torch's CPU kernel layout
    assert layer.kernel_layout
    weight, codes, scale, minimum = layer.dequantize(), layer.unpacked(), layer.scale, layer.minimum
    layer = layer.cuda()
    assert not layer.kernel_layout and not hasattr(layer, "kernel_scales_and_zeros")
    # The codes survive the repacking exactly; the scales and minimums are kept to fp16's
    # precision on CUDA (Int4Linear.compact_scales).
    assert torch.equal(layer.unpacked().cpu(), codes)
    assert torch.equal(layer.scale.cpu(), scale.half()) and torch.equal(layer.minimum.cpu(), minimum.half())
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    assert relative_error(layer(x), x, weight.cuda()) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", (1, 4))
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_kernels_replay_in_a_cuda_graph(kind, rows) -> None:
    if kind.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    layer = make_layer(kind, 1024, 4096, device="cuda")
    static_x = torch.zeros(rows, 4096, device="cuda", dtype=torch.bfloat16)
    layer(static_x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(static_y, layer(x))


@pytest.mark.gpu
@requires_cuda
def test_gpu_kernels_switch_off_to_the_dense_path(monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_QUANTIZED_GPU_KERNELS", "0")
    layer = make_layer("int8", 256, 512, device="cuda")
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), layer.dense_matmul(x), rtol=0, atol=0)
