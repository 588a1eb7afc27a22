"""weight_only_matmul: picks the kernel and launch configuration for a call (configs.py),
splits K to fill the GPU, and launches; one launch per linear (split-K partials summed in
the kernel)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from kvserve.ops import device as device_info
from kvserve.ops import pdl
from kvserve.ops.pending_norm import PendingNorm
from kvserve.ops.quant.weight_only.configs import MMA_MAX_ROWS, LaunchConfig, default_config
from kvserve.ops.quant.weight_only.generic import weight_only_gemv_kernel, weight_only_matmul_kernel
from kvserve.ops.quant.weight_only.mma import fp8_mma_kernel, int4_mma_kernel
from kvserve.ops.quant.weight_only.words import (
    fp8_dot_kernel,
    fp8_gemv_kernel,
    int4_dot_kernel,
    int4_gemv_kernel,
)
from kvserve.ops.split_k import MAX_SPLIT_COUNTERS, split_counters


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


# The register limit the 4-bit one-row word kernel is compiled with (see _words_matmul).
WORD_KERNEL_MAX_REGISTERS = 255


class AddNorm(NamedTuple):
    """The residual add and RMSNorm after a linear, fused into its kernel: residual [M, N]
    (contiguous, updated in place to residual + y) and the norm's weight [N]."""
    residual: torch.Tensor
    weight: torch.Tensor


def _block_k(config: LaunchConfig, in_features: int, group_size: int, grouped: bool, four_bit: bool) -> int | None:
    """The K tile: within one group when grouped (halved until it divides the group size),
    or two whole groups for the 4-bit CUDA-core kernel (longer runs of each weight row);
    at least 16 stored elements (tl.dot's minimum); None when no tile fits."""
    block_k = config.block_k
    if config.words == "mma":
        return block_k  # checked with the rest of its conditions by mma_applies
    if (four_bit and config.words == "fma" and block_k == 2 * group_size and group_size % 32 == 0
            and in_features % block_k == 0):
        return block_k
    if grouped:
        while block_k > 16 and group_size % block_k:
            block_k //= 2
        if group_size % block_k:
            return None
    if block_k // (2 if four_bit else 1) < 16:
        return None
    return block_k


def split_k(config: LaunchConfig, num_tiles: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(splits, tiles per split): config.split_k, else enough splits for about `waves`
    programs per SM on CUDA; every split gets at least one tile. The word and mma kernels
    with config.even_splits spread the tiles over those splits as evenly as they go."""
    split = config.split_k or 1
    if config.split_k is None and device.type == "cuda":
        split = max(1, min(num_tiles, triton.cdiv(config.waves * device_info.num_sms(device), programs)))
    tiles_per_split = triton.cdiv(num_tiles, split)
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split


def _mma_shape_applies(m: int, in_features: int, dtype: torch.dtype, device: torch.device, group_size: int,
                       grouped: bool, block_k: int) -> bool:
    """mma_applies for x's shape, dtype and device alone (x itself loading as aligned pairs)."""
    return (device.type == "cuda" and m <= MMA_MAX_ROWS and dtype in (torch.bfloat16, torch.float16)
            and in_features % block_k == 0 and (not grouped or group_size % 128 == 0)
            and _capability(device.index or 0) >= (8, 0))


def mma_applies(rows: torch.Tensor, group_size: int, grouped: bool, block_k: int) -> bool:
    """The mma.sync kernels: CUDA (sm_80 on), up to MMA_MAX_ROWS rows of bf16/fp16 x that
    load as aligned pairs, K in whole tiles and groups of whole 128-wide halves (or one a row)."""
    return (rows.stride(0) % 2 == 0 and rows.data_ptr() % 4 == 0
            and _mma_shape_applies(rows.shape[0], rows.shape[1], rows.dtype, rows.device, group_size, grouped,
                                   block_k))


def _words_apply(qweight: torch.Tensor, in_features: int, block_k: int, four_bit: bool, fp8: bool) -> bool:
    """The word kernels take whole K tiles of rows that start on a word."""
    if not (four_bit or fp8) or in_features % block_k:
        return False
    return qweight.stride(-1) == 1 and qweight.stride(0) % 4 == 0 and qweight.data_ptr() % 4 == 0


def _words_matmul(
    rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    group_size: int, config: LaunchConfig, block_k: int, pending: PendingNorm | None = None,
    add_norm: AddNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows [M, K] times the nibble pairs or e4m3 values read as int32 words, by
    config.words; split-K partials summed in the kernel. Returns y and, with add_norm, the
    row sums of h^2 it leaves pending (PendingNorm.sums)."""
    m, k = rows.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out, None
    dot = config.words == "dot"
    block_m = max(16, config.block_m) if dot else config.block_m  # tl.dot's minimum
    num_tiles = k // block_k
    # An mma program takes all rows (up to MMA_MAX_ROWS).
    grid_n, grid_m = triton.cdiv(n, config.block_n), 1 if config.words == "mma" else triton.cdiv(m, block_m)
    split, tiles_per_split = split_k(config, num_tiles, grid_n * grid_m, rows.device)
    if grid_n * grid_m > MAX_SPLIT_COUNTERS:
        split, tiles_per_split = 1, num_tiles
    partial = torch.empty((split, m, n), dtype=torch.float32, device=rows.device) if split > 1 else out
    words = qweight.view(torch.int32)
    x_tiles = triton.next_power_of_2(triton.cdiv(m, 8))  # mma: 8 rows of x an MMA's B
    sums = torch.empty((m, grid_n), dtype=torch.float32, device=rows.device) if add_norm is not None else None
    pending_sums, norm_args, norm_flags = _pending_operands(pending, out)
    residual, norm_weight = add_norm if add_norm is not None else (out, out)
    norm_pointers = (pending_sums, residual, norm_weight, sums if sums is not None else out)
    if config.words == "mma" and qweight.dtype == torch.float8_e4m3fn:
        fp8_mma_kernel[(grid_n, 1, split)](
            rows, words, scale, partial, out, split_counters(rows.device), *norm_pointers,
            m, n, num_tiles, tiles_per_split, group_size,
            rows.stride(0), words.stride(0), scale.stride(0), m * n, n, *norm_args,
            X_BF16=rows.dtype == torch.bfloat16, SPLIT=split > 1, EVEN_SPLITS=config.even_splits,
            ROW_TILES=config.block_n // (16 * config.num_warps), NUM_WARPS=config.num_warps, X_TILES=x_tiles,
            ADD_NORM=add_norm is not None, num_warps=config.num_warps, num_stages=1,
            # A programmatic dependent: waits for the previous kernel after its first tile.
            **pdl.chained_options(rows.device), **norm_flags,
        )
        return out, sums
    if config.words == "mma":
        fp16 = rows.dtype == torch.float16
        int4_mma_kernel[(grid_n, 1, split)](
            rows, words, scale, offset if offset is not None else scale, partial, out, split_counters(rows.device),
            pending_sums, m, n, num_tiles, tiles_per_split, group_size, 0x64006400 if fp16 else 0x43004300,
            rows.stride(0), words.stride(0), scale.stride(0), m * n, n, *norm_args,
            FP16=fp16, HAS_OFFSET=offset is not None, SPLIT=split > 1, EVEN_SPLITS=config.even_splits,
            ROW_TILES=config.block_n // (16 * config.num_warps), NUM_WARPS=config.num_warps, X_TILES=x_tiles,
            LAUNCH_NEXT=pdl.enabled(rows.device), num_warps=config.num_warps, num_stages=1,
            **norm_flags,
        )
        return out, None
    fp8 = qweight.dtype == torch.float8_e4m3fn
    flags, launch = {}, {}
    if not dot:
        # bf16 pairs load as one int32 where aligned.
        aligned = rows.data_ptr() % 4 == 0 and rows.stride(0) % 2 == 0
        flags["X_BF16"] = rows.dtype == torch.bfloat16 and aligned
        # The one-row kernels, whose launch latency matters most (kvserve.ops.pdl).
        launch = pdl.launch_options(rows.device)
        flags["PDL"] = bool(launch)
    if fp8:
        kernel = fp8_dot_kernel if dot else fp8_gemv_kernel
        pointers, flags["GROUPED"] = (scale,), scale.shape[1] > 1
    else:
        kernel = int4_dot_kernel if dot else int4_gemv_kernel
        pointers, flags["HAS_OFFSET"] = (scale, offset if offset is not None else scale), offset is not None
        if not dot:
            flags["TWO_GROUPS"] = block_k == 2 * group_size
    norm_scalars = ()
    if kernel is int4_gemv_kernel:  # the word kernel that takes the fused norms' operands
        norm_scalars = norm_args
        flags.update(norm_flags, ADD_NORM=add_norm is not None)
        if rows.is_cuda:
            # Left to itself, ptxas gives the fused variants 168 registers and issues the next
            # tile's weight loads at the end of the loop instead of its middle (down: 17.9 ->
            # 21.6 us on an H100); an explicit limit of 255 keeps the plain kernel's schedule.
            launch = {**launch, "maxnreg": WORD_KERNEL_MAX_REGISTERS}
    else:
        norm_pointers = ()
    # 1.0f as a run-time value: ptxas then merges mask and OR into one LOP3.
    one_bits = () if fp8 else (0x3F800000,)
    kernel[(grid_n, grid_m, split)](
        rows, words, *pointers, partial, out, split_counters(rows.device), *norm_pointers,
        m, n, num_tiles, tiles_per_split, max(1, group_size // block_k), *one_bits,
        rows.stride(0), words.stride(0), scale.stride(0), m * n, n, *norm_scalars,
        SPLIT=split > 1, EVEN_SPLITS=config.even_splits, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **flags, **launch,
    )
    return out, sums


def _pending_operands(
    pending: PendingNorm | None, placeholder: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, float], dict[str, object]]:
    """A consumer kernel's operands for a pending norm (None: the placeholder and no
    ROW_SCALE): its sums, (their partial count, eps), and the ROW_SCALE / PARTIALS flags."""
    if pending is None:
        return placeholder, (0, 0.0), {"ROW_SCALE": False, "PARTIALS": 1}
    partials = pending.sums.shape[1]
    return pending.sums, (partials, pending.eps), {"ROW_SCALE": True, "PARTIALS": triton.next_power_of_2(partials)}


def _call_plan(
    m: int, in_features: int, dtype: torch.dtype, device: torch.device, pairs_aligned: bool,
    qweight: torch.Tensor, scale: torch.Tensor, group_size: int, four_bit: bool, config: LaunchConfig | None,
) -> tuple[LaunchConfig, int | None, bool]:
    """For m rows of x [m, in_features] (dtype, device; whether they load as aligned bf16/fp16
    pairs): the call's config, its K tile (None: no kernel applies) and whether the int32-word
    kernels take it."""
    grouped = scale.shape[1] > 1
    fp8 = qweight.dtype == torch.float8_e4m3fn
    config = config or default_config(m, four_bit, fp8, qweight.shape[0])
    if config.words == "mma" and not (pairs_aligned and _mma_shape_applies(m, in_features, dtype, device, group_size,
                                                                          grouped, config.block_k)):
        # No CUDA (the interpreter), groups narrower than 128, K not whole mma tiles.
        config = default_config(m, four_bit, fp8, qweight.shape[0], mma=False)
    block_k = _block_k(config, in_features, group_size, grouped, four_bit)
    if block_k is None or (four_bit and in_features % block_k):
        return config, None, False
    return config, block_k, bool(config.words) and _words_apply(qweight, in_features, block_k, four_bit, fp8)


def _words_plan(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group_size: int, four_bit: bool,
    config: LaunchConfig | None,
) -> tuple[torch.Tensor, LaunchConfig, int | None, bool]:
    """(x as [M, K] rows, then _call_plan's config, K tile and word-kernel answer)."""
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    aligned = rows.stride(0) % 2 == 0 and rows.data_ptr() % 4 == 0
    plan = _call_plan(rows.shape[0], in_features, rows.dtype, rows.device, aligned, qweight, scale, group_size,
                      four_bit, config)
    return rows, *plan


def _folds_norms(qweight: torch.Tensor, config: LaunchConfig, four_bit: bool, words: bool) -> bool:
    """The kernels that take a pending RMSNorm (PendingNorm): 4-bit weights on the CUDA-core
    word kernel or mma.sync; fp8 weights on mma.sync or the one-row byte kernel."""
    if qweight.dtype == torch.float8_e4m3fn:
        return config.words == "mma" if words else config.block_m == 1 and not config.words
    return words and four_bit and config.words in ("fma", "mma")


def _adds_norms(qweight: torch.Tensor, config: LaunchConfig, four_bit: bool, words: bool, m: int) -> bool:
    """The kernels that leave the next RMSNorm pending (weight_only_matmul_add_norm): the
    4-bit CUDA-core word kernel, and fp8 weights on mma.sync at one row: the batch where
    the fusion was measured to pay (W2 fp8); at 2-128 rows on Hopper the norm's own kernel
    quantizes fp8_w8a8's input instead."""
    if qweight.dtype == torch.float8_e4m3fn:
        return words and config.words == "mma" and m == 1
    return words and four_bit and config.words == "fma"


def folds_pending_norm(
    m: int, dtype: torch.dtype, device: torch.device, qweight: torch.Tensor, scale: torch.Tensor, group_size: int,
    four_bit: bool,
) -> bool:
    """Whether weight_only_matmul finishes a pending RMSNorm (`pending`) in its kernel for m
    rows of x in `dtype` on `device`, as the rows a fused producer writes (contiguous,
    aligned): the producer leaves a norm pending only then (RMSNorm.add_after)."""
    in_features = qweight.shape[1] * (2 if four_bit else 1)
    config, block_k, words = _call_plan(m, in_features, dtype, device, True, qweight, scale, group_size, four_bit,
                                        None)
    return block_k is not None and _folds_norms(qweight, config, four_bit, words)


def weight_only_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    group_size: int, four_bit: bool = False, config: LaunchConfig | None = None,
    pending: PendingNorm | None = None,
) -> torch.Tensor | None:
    """x [..., K] (bf16/fp16; fp32 too under the interpreter) times the quantized weight.
    qweight [N, K] int8 / float8_e4m3fn, or uint8 [N, K / 2] nibble pairs (four_bit,
    contiguous); scale and offset fp32 or fp16 [N, K / group_size]. None where the kernel
    does not apply (odd K for 4-bit, groups narrower than a tile): the caller dequantizes
    instead. With `pending` (x is pending.rows), x's RMSNorm is finished in the kernel, and None where the call's
    kernel cannot (the caller finishes x first)."""
    in_features = x.shape[-1]
    n = qweight.shape[0]
    if four_bit and in_features % 2:
        return None
    rows, config, block_k, words = _words_plan(x, qweight, scale, group_size, four_bit, config)
    if pending is not None and not _folds_norms(qweight, config, four_bit, words):
        return None
    if block_k is None:
        return None
    if words:
        y, _ = _words_matmul(rows, qweight, scale, offset, group_size, config, block_k, pending)
        return y.reshape(*x.shape[:-1], n)
    grouped = scale.shape[1] > 1
    fp8 = qweight.dtype == torch.float8_e4m3fn
    m = rows.shape[0]
    num_tiles = triton.cdiv(in_features, block_k)
    programs = triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m)
    split, tiles_per_split = split_k(config, num_tiles, programs, x.device)
    # e4m3 weights go in as their uint8 bits: masked lanes then load as +0.0, never a NaN.
    weight = qweight.view(torch.uint8) if fp8 else qweight
    # Split-K partials stay fp32 and are summed in one fixed order (deterministic).
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    if m and config.block_m == 1:
        pending_sums, norm_args, norm_flags = _pending_operands(pending, out)
        weight_only_gemv_kernel[(triton.cdiv(n, config.block_n), m, split)](
            rows, weight, scale, offset if offset is not None else scale, out, pending_sums,
            n, in_features, group_size, tiles_per_split,
            rows.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1), *norm_args,
            FOUR_BIT=four_bit, FP8=fp8, GROUPED=grouped, HAS_OFFSET=offset is not None,
            EVEN_K=in_features % block_k == 0, BLOCK_N=config.block_n, BLOCK_K=block_k,
            LAUNCH_NEXT=pdl.enabled(x.device), num_warps=config.num_warps,
            num_stages=config.num_stages, **norm_flags,
        )
    elif m:
        weight_only_matmul_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)](
            rows, weight, scale, offset if offset is not None else scale, out,
            m, n, in_features, group_size, tiles_per_split,
            rows.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1),
            FOUR_BIT=four_bit, FP8=fp8, GROUPED=grouped, HAS_OFFSET=offset is not None,
            EVEN_K=in_features % block_k == 0,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    y = out[0] if split == 1 else out.sum(0).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def weight_only_matmul_add_norm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    group_size: int, add_norm: AddNorm, four_bit: bool = False, config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight_only_matmul followed by the residual add and the RMSNorm after it, in the
    kernel's epilogue where the call runs on the 4-bit CUDA-core word kernel or the fp8
    mma.sync kernel: returns (h * the norm's weight, the row sums of h^2 (PendingNorm.sums))
    with the residual updated to h = residual + x W^T, or None (nothing written) where those
    kernels do not run the call."""
    rows, config, block_k, words = _words_plan(x, qweight, scale, group_size, four_bit, config)
    residual = add_norm.residual
    if (block_k is None or not _adds_norms(qweight, config, four_bit, words, rows.shape[0])
            or not residual.is_contiguous() or residual.shape != (rows.shape[0], qweight.shape[0])):
        return None
    return _words_matmul(rows, qweight, scale, offset, group_size, config, block_k, add_norm=add_norm)
