"""Launch configurations of the weight-only kernels and the per-row-count routing that
`kvserve bench quantized-linears --sweep` chose: which kernel, tile and split-K a call of a
given shape takes."""

from __future__ import annotations

from dataclasses import dataclass


# Row counts up to this run the decode configuration (one padded 16-row tile).
SMALL_ROWS = 16


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 2  # split K until about this many programs per SM
    split_k: int | None = None  # fixed split (tests); None: from `waves` on CUDA, else 1
    # 4-bit and fp8 weights: the int32-word kernel, "fma" (CUDA cores) or "dot" (tensor
    # cores, block_m >= 16), block_m rows per program; or "mma" (tensor cores through
    # mma.sync, all rows (up to MMA_MAX_ROWS) in one program, block_n = 16 x row tiles x
    # num_warps; K tiles of 256 for 4-bit weights, 128 for fp8).
    # None (and int8 weights): block_m 1 is the CUDA-core kernel, one row per program (reads
    # W once per row), else tl.dot tiles.
    words: str | None = None
    # Split-K's layout (the word and mma kernels: tiles.split_tiles): runs of ceil(tiles /
    # splits) tiles with the remainder in the last split (False), or runs as even as they go,
    # the shorter ones last (True). The splits launched last are the programs that overflow
    # the first wave, and the layout decides how long they run. fp8's one-row mma kernel (5
    # programs an SM) runs llama3-8b's down in 23 splits of 112 tiles, 76 programs past the
    # first wave, which take 4 tiles each rather than 5 (W2 fp8 GPU step 3.50 -> 3.39 ms on
    # an H100, 2.84 -> 2.73 on an H200). The int4 word kernel's qkv (2 programs an SM, 24
    # past the wave) wants its 1-tile remainder there instead (even splits everywhere: int4
    # 2.43 -> 2.49 ms on the H100).
    even_splits: bool = False


# 4-bit weights, (most rows, config): the first entry that covers the row count. The fastest
# per step's linears of `kvserve bench quantized-linears --sweep --sweep-formats int4` on an
# H100 (llama3-8b): 1 row 2.36 ms (tiles of two 128-wide groups; bf16 cuBLAS
# 5.17), 4 and 8 rows 3.02 and 3.14 (mma.sync; the tl.dot tiles took 4.52 and 4.59). On an
# H200, 16 and 32 rows on mma.sync with 2 and 4 tiles of x: 3.59 and 5.00 ms (the tl.dot tiles
# 4.47 and 8.02; bf16 3.77 and 3.79); at 64 rows the tl.dot tiles, 8.65 (bf16 4.04): above 16
# rows 4-bit weights cost time, they save memory.
INT4_MMA_CONFIG = LaunchConfig(8, 128, 256, num_warps=4, num_stages=1, waves=2, words="mma")


# Where the mma kernel does not apply (groups narrower than 128, K not whole 256-k tiles).
INT4_TILE_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (SMALL_ROWS, LaunchConfig(16, 64, 128, num_stages=1, waves=4, words="dot")),
    (64, LaunchConfig(64, 64, 128, num_stages=1, waves=2, words="dot")),
)


INT4_DECODE_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (1, LaunchConfig(1, 128, 256, num_stages=1, waves=2, words="fma")),
    (8, INT4_MMA_CONFIG),
    # 9-16 rows (two x tiles), the narrow linears; the wide gate/up takes
    # INT4_WIDE_TWO_TILES_CONFIG. Every config at 9, 12 and 16 rows, by linear (H100): 64
    # weight rows on 4 warps, 4 programs an SM, is the narrow ones' best at each (qkv + o +
    # down 49.4 / 52.8 / 58.3 us a layer). Routed, a step's linears take 2.83 / 2.95 / 3.14
    # ms, against 3.07 / 3.17 / 3.31 with 64 rows on 2 warps for all four linears and 3.08 /
    # 3.22 / 3.58 with 32 rows on 2 warps.
    (16, LaunchConfig(16, 64, 256, num_warps=4, num_stages=1, waves=4, words="mma")),
    (32, LaunchConfig(32, 128, 256, num_warps=4, num_stages=1, waves=2, words="mma")),
    INT4_TILE_CONFIGS[-1],
)


# gate/up (a wide linear) at 9-16 rows of 4-bit weights: 128 weight rows on 2 warps, 2
# programs an SM: 38.9 / 39.2 / 39.8 us at 9 / 12 / 16 rows on the H100, against 44.6 / 49.0 /
# 57.0 for the narrow linears' config.
INT4_WIDE_TWO_TILES_CONFIG = LaunchConfig(16, 128, 256, num_warps=2, num_stages=1, waves=2, words="mma")


# One row of x against at least this many weight rows (llama3-8b's fused gate/up, 28672): a
# wide linear, which one row (and 4-bit weights at 9-16 rows) runs on other kernels than the
# narrow ones. 4-bit weights take the mma config there at one row: 28.6 against 32.6 us on
# the H100, where the narrower linears stayed faster on the CUDA cores (qkv 10.1 against
# 11.4, o 8.3 / 9.1, down 17.4 / 19.2).
WIDE_AT_ONE_ROW_OUT_FEATURES = 16384


# fp8 weights, the same form, from `--sweep --sweep-formats fp8-triton` on the H100: 4 and 8
# rows 3.41 and 3.49 ms per llama3-8b step's linears on mma.sync (the byte tl.dot tiles: 3.60,
# 3.58). On an H200, 16 rows on mma.sync with 2 tiles of x: 3.22 ms (the byte tiles 3.60, bf16
# 3.68); at 32 rows the byte tiles (4.90; mma.sync 5.16). One row, by linear (H100, two
# sweeps): mma.sync for the narrow ones, the byte kernel for the wide gate/up below.
# At one row they split K for about 6 programs an SM, chosen inside the decode step rather than
# alone (W2 fp8 GPU step, 4 -> 6: H200 3.01 -> 2.94 ms, H100 3.63-3.64 -> 3.61-3.62; 8 and 12
# are slower on both): qkv 11 -> 16 splits, down 16 -> 23, o stays at 16; 5 an SM instead:
# no faster (H100). Even splits: see LaunchConfig.even_splits.
FP8_MMA_CONFIG = LaunchConfig(16, 128, 128, num_warps=4, num_stages=1, waves=2, words="mma")


FP8_DECODE_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (1, LaunchConfig(8, 128, 128, num_warps=4, num_stages=1, waves=6, words="mma", even_splits=True)),
    (SMALL_ROWS, FP8_MMA_CONFIG),
)


# One row where the mma kernel does not apply (groups narrower than 128, K not whole tiles).
FP8_ONE_ROW_WORDS_CONFIG = LaunchConfig(1, 64, 256, num_stages=1, waves=4, words="fma")


# One row of x against a wide fp8 weight (WIDE_AT_ONE_ROW_OUT_FEATURES): the
# byte CUDA-core kernel, no split of K (llama3-8b's gate/up: 42.4 against 47.4 us on mma.sync
# and 51.2 on the word kernel, 92% of its bytes floor).
FP8_WIDE_ONE_ROW_CONFIG = LaunchConfig(1, 32, 256)


# int8 weights against a wide linear (WIDE_AT_ONE_ROW_OUT_FEATURES) at up to SMALL_ROWS rows:
# tl.dot tiles 256 k deep. On the H100, llama3-8b's int8 LM head (128256 rows) at 1, 4 and
# 16 rows: 188, 190 and 194 us (2.7-2.8 TB/s), against 204-220 us with 128-k tiles or the
# byte kernel at one row (bf16 cuBLAS: 389); gate/up at one row 49.1 us (128-k tiles 49.2,
# the byte kernel 53.9).
INT8_WIDE_CONFIG = LaunchConfig(16, 64, 256)


def default_config(rows: int, four_bit: bool, fp8: bool, out_features: int = 0, mma: bool = True) -> LaunchConfig:
    """int8 picked from llama3-8b's linears on an H200: at one row tl.dot
    tiles beat the CUDA-core kernel (3.47 against 3.88 ms per step's linears), 256 k deep on
    wide linears (INT8_WIDE_CONFIG); 4-bit and fp8 weights: INT4_DECODE_CONFIGS and
    FP8_DECODE_CONFIGS, and the rules for wide linears above (one row; 4-bit weights at 9-16
    rows). mma=False: the configs for weights the mma kernels do not take."""
    if rows == 1 and out_features >= WIDE_AT_ONE_ROW_OUT_FEATURES:
        if four_bit and mma:
            return INT4_MMA_CONFIG
        if fp8:
            return FP8_WIDE_ONE_ROW_CONFIG
    if four_bit and mma and 8 < rows <= SMALL_ROWS and out_features >= WIDE_AT_ONE_ROW_OUT_FEATURES:
        return INT4_WIDE_TWO_TILES_CONFIG
    if not (four_bit or fp8) and rows <= SMALL_ROWS and out_features >= WIDE_AT_ONE_ROW_OUT_FEATURES:
        return INT8_WIDE_CONFIG
    table = INT4_DECODE_CONFIGS if four_bit else FP8_DECODE_CONFIGS if fp8 else ()
    if not mma:
        table = INT4_TILE_CONFIGS if four_bit else ((1, FP8_ONE_ROW_WORDS_CONFIG),) if fp8 else ()
    if table and rows <= table[-1][0]:
        return next(config for most_rows, config in table if rows <= most_rows)
    if rows <= SMALL_ROWS:
        return LaunchConfig(16, 64, 128)
    return LaunchConfig(64, 128, 64)


# Most rows of x the mma.sync kernels take: 8 X_TILES, X_TILES a power of two up to 4 (at
# 64 rows, 8 tiles, the kernels spill registers and lose to tl.dot tiles).
MMA_MAX_ROWS = 32
