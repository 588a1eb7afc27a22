"""RMSNorm fused into the int4 linears around it (PendingNorm): the producer's epilogue adds
its output to the residual stream and leaves the norm's sums, the consumer scales its output
rows. Checked against the unfused chain computed in fp64 from the same stored weights:
y1 = x W1^T rounded to the run dtype, h = residual + y1 rounded, RMSNorm(h) as the torch
path rounds it, then y2 = RMSNorm(h) W2^T.

Without a GPU the word kernel runs under Triton's interpreter (one subprocess); on CUDA
llama3-8b's two pairs run the one-row word kernel and mma.sync, and mma.sync finishes
pending rows at 2-32 rows. The engine-level decode test is in
tests/gpu/test_quantized_engine_gpu.py."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import torch

from kvserve.model_executor.layers.layernorm import PendingNorm, RMSNorm
from kvserve.quantization.int4 import Int4Linear, quantize_int4
from kvserve.quantization.weight_only import LaunchConfig
from kvserve.quantization.weight_only.matmul import (
    AddNorm,
    weight_only_matmul,
    weight_only_matmul_add_norm,
)
from tests.triton_interpreter import run_interpreted

EPS = 1e-5
# Worst relative error per row against the fp64 chain: the run dtype's rounding of x, y1, h
# and of the consumer's input, a few ulps.
TOLERANCE = {torch.float32: 3e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


class ChainCase(NamedTuple):
    """x [rows, k] -> producer (hidden x k) -> add + norm -> consumer (n x hidden); the
    producer's config (block_m, block_n, block_k, split), None for default_config."""
    rows: int
    k: int
    hidden: int
    n: int
    group_size: int
    config: tuple[int, int, int, int | None] | None = None

    @property
    def id(self) -> str:
        return f"m{self.rows}-k{self.k}-h{self.hidden}-n{self.n}-g{self.group_size}-{self.config}"


# 3 and 4 column blocks of the hidden size (the sums' partial count not a power of two, and
# one), split K, several rows of the CUDA-core kernel, the default one-row config.
CHAIN_CASES = [
    ChainCase(1, 512, 192, 37, 64, (1, 64, 128, 2)),
    ChainCase(1, 256, 256, 21, 128, (1, 64, 256, None)),
    ChainCase(3, 512, 192, 19, 64, (4, 64, 128, 3)),
    ChainCase(1, 512, 256, 37, 128),
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _int4_layer(n: int, k: int, group_size: int, seed: int, device: str) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(device)
    return Int4Linear(*quantize_int4(weight, group_size), group_size, None)


def _stored(layer: Int4Linear) -> tuple:
    qweight = layer.qweight.view(layer.out_features, layer.in_features // 2)
    return qweight, layer.scale, layer.minimum, layer.group_size


def _weight(layer: Int4Linear) -> torch.Tensor:
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
    producer = _int4_layer(case.hidden, case.k, case.group_size, 1, device)
    consumer = _int4_layer(case.n, case.hidden, case.group_size, 2, device)

    y1 = (x.double() @ _weight(producer).T.to(device)).to(dtype)
    h = residual + y1
    expected_norm = norm._norm(h)  # the torch path's roundings
    expected_y2 = expected_norm.double() @ _weight(consumer).T.to(device)

    config = None if case.config is None else LaunchConfig(*case.config[:3], split_k=case.config[3], words="fma")
    fused = weight_only_matmul_add_norm(x, *_stored(producer), AddNorm(residual, norm.weight), four_bit=True,
                                        config=config)
    assert fused is not None
    pending = PendingNorm(*fused, EPS)
    assert pending.sums.shape == (case.rows, -(-case.hidden // (config or LaunchConfig(1, 128, 256)).block_n))
    y2 = weight_only_matmul(pending.rows, *_stored(consumer), four_bit=True, pending=pending,
                            config=LaunchConfig(1, 16, 64, split_k=2, words="fma") if device == "cpu" else None)
    assert y2 is not None and y2.dtype == dtype
    finished_y2 = weight_only_matmul(pending.finish(), *_stored(consumer), four_bit=True)
    return {
        "residual": _relative(residual, h),
        "sums": abs(pending.sums.double().sum().item() / residual.double().pow(2).sum().item() - 1),
        "norm": _relative(pending.finish(), expected_norm),
        "consumer": _relative(y2, expected_y2),
        "consumer_after_finish": _relative(finished_y2, expected_y2),
    }


def run_chain_cases() -> None:
    """Subprocess entry: print {case: errors} as JSON."""
    print(json.dumps({f"{case.id}-{str(dtype).removeprefix('torch.')}": chain_errors(case, dtype, "cpu")
                      for case in CHAIN_CASES for dtype in DTYPES}))


@pytest.fixture(scope="module")
def interpreted_chains() -> dict[str, dict[str, float]]:
    pytest.importorskip("triton")
    return json.loads(run_interpreted("tests.quantization.test_fused_norm", "run_chain_cases"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CHAIN_CASES, ids=lambda case: case.id)
def test_interpreted_fused_norm_chain_matches_unfused(case, dtype, interpreted_chains) -> None:
    errors = interpreted_chains[f"{case.id}-{str(dtype).removeprefix('torch.')}"]
    assert errors["sums"] <= 1e-6
    for output in ("residual", "norm", "consumer", "consumer_after_finish"):
        assert errors[output] <= TOLERANCE[dtype], (output, errors)


def test_add_norm_declines_what_its_kernel_does_not_run() -> None:
    """Nothing is written where the call would not run on the CUDA-core word kernel: more
    rows than its config (tl.dot tiles), or a residual that is not [rows, N] contiguous."""
    producer = _int4_layer(64, 256, 64, 1, "cpu")
    x = torch.randn(3, 256)
    residual = torch.randn(3, 64)
    before = residual.clone()
    dot = LaunchConfig(16, 32, 64, words="dot")
    assert weight_only_matmul_add_norm(x, *_stored(producer), AddNorm(residual, torch.ones(64)), four_bit=True,
                                       config=dot) is None
    assert weight_only_matmul_add_norm(x, *_stored(producer), AddNorm(residual[:, :32], torch.ones(32)),
                                       four_bit=True, config=LaunchConfig(4, 32, 64, words="fma")) is None
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


@pytest.mark.parametrize(("n", "k", "group_size", "rows", "dtype", "device", "folds"), [
    (28672, 4096, 128, 1, torch.bfloat16, "cuda", True),   # gate/up, mma.sync
    (28672, 4096, 64, 1, torch.bfloat16, "cuda", False),   # 64-wide groups: tl.dot tiles
    (28672, 4096, 128, 8, torch.float16, "cuda", True),    # mma.sync, 8 rows
    (28672, 4096, 128, 40, torch.bfloat16, "cuda", False),  # past mma.sync's 32 rows
    (6144, 4096, 128, 1, torch.bfloat16, "cuda", True),    # qkv, the one-row word kernel
    (28672, 4096, 128, 1, torch.bfloat16, "cpu", False),   # no mma.sync off CUDA
    (6144, 4096, 128, 1, torch.bfloat16, "cpu", True),     # the word kernel (interpreter)
])
def test_consumers_that_fold_a_pending_norm(n, k, group_size, rows, dtype, device, folds, monkeypatch) -> None:
    """Which next linears finish a pending norm in their kernel (so that the linear before the
    norm leaves it pending): the word kernel and mma.sync, by llama3-8b's shapes, on an sm_90
    device (its capability stands in for a GPU here)."""
    from kvserve.quantization.weight_only import matmul
    from kvserve.quantization.weight_only.matmul import folds_pending_norm

    monkeypatch.setattr(matmul, "_capability", lambda index: (9, 0))
    qweight = torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.ones(n, k // group_size, dtype=torch.float16)
    assert folds_pending_norm(rows, dtype, torch.device(device), qweight, scale, group_size, four_bit=True) is folds


# -- CUDA ------------------------------------------------------------------------------------

# llama3-8b's pairs at one row: o_proj -> gate/up (word kernel -> mma.sync), down -> qkv
# (word kernel -> word kernel), in groups of 128.
GPU_CHAINS = [ChainCase(1, 4096, 4096, 28672, 128), ChainCase(1, 14336, 4096, 6144, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("case", GPU_CHAINS, ids=lambda case: case.id)
def test_gpu_fused_norm_chain_matches_unfused(case, dtype) -> None:
    errors = chain_errors(case, dtype, "cuda")
    assert errors["sums"] <= 1e-5
    for output in ("residual", "norm", "consumer", "consumer_after_finish"):
        assert errors[output] <= TOLERANCE[dtype], (output, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (2, 5, 8, 16, 32))
def test_gpu_mma_kernel_finishes_pending_rows(rows) -> None:
    """mma.sync with 1-4 x tiles scales each row by its own factor (sums made by torch)."""
    generator = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 4096, generator=generator) * (1 + torch.arange(rows)[:, None])).bfloat16().cuda()
    weight = (1 + torch.randn(4096, generator=generator) * 0.1).bfloat16().cuda()
    layer = _int4_layer(28672, 4096, 128, 4, "cuda")
    sums = h.float().pow(2).reshape(rows, 32, 128).sum(-1)
    rows_in = (h.float() * weight.float()).bfloat16()
    y = weight_only_matmul(rows_in, *_stored(layer), four_bit=True, pending=PendingNorm(rows_in, sums, EPS))
    assert y is not None
    normed = RMSNorm(4096, EPS).cuda().bfloat16()
    with torch.no_grad():
        normed.weight.copy_(weight)
    expected = normed._norm(h).double() @ _weight(layer).T.cuda()
    assert _relative(y, expected) <= TOLERANCE[torch.bfloat16]
