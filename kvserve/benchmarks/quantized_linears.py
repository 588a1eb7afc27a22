"""`kvserve bench quantized-linears`: device time of llama3-8b's decoder-layer linears per
weight format (bf16 cuBLAS, the Triton W8A16 / W4A16 / fp8-weight kernels, fp8
torch._scaled_mm and kvserve's fp8 W8A8 kernel (both with the per-token quantization of
x), and the dequantize-then-cuBLAS path) at a few row counts, beside the
floor: the bytes each call must move (weights as stored, activations in and out) over the
copy bandwidth measured in the same run. `--sweep` also times the Triton kernels' launch
configs on the linears as the engine runs them (q/k/v and gate/up fused), beside bf16, and
prints each row count's fastest config per step: what `default_config` should pick.

Each measurement replays a CUDA graph of back-to-back calls (as decode steps run), cycling
over enough weight copies that they do not fit the L2 cache.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.benchmarks.graph_timing import replay_us
from kvserve.benchmarks.roofline import copy_bandwidth
from kvserve.ops.quant.fp8_w8a8 import decode_config
from kvserve.ops.quant.weight_only import LaunchConfig, weight_only_matmul
from kvserve.quantization.base import QuantizedLinear
from kvserve.quantization.fp8 import Fp8Linear, quantize_fp8
from kvserve.quantization.int4 import Int4Linear, quantize_int4
from kvserve.quantization.int8 import Int8Linear

# llama3-8b: (name, out features, in features), once per decoder layer each.
LLAMA3_8B_LINEARS = [
    ("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("v_proj", 1024, 4096), ("o_proj", 4096, 4096),
    ("gate_proj", 14336, 4096), ("up_proj", 14336, 4096), ("down_proj", 4096, 14336),
]
LLAMA3_8B_LAYERS = 32
# The same weights as kvserve's llama runs them: q/k/v and gate/up as one linear each.
LLAMA3_8B_ENGINE_LINEARS = [
    ("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336),
]
FORMATS = ("bf16", "int8", "int4", "fp8-triton", "fp8-scaled_mm", "fp8-w8a8", "int8-dequant", "int4-dequant")
SWEEP_FORMATS = ("int8", "int4", "fp8-triton")
L2_BYTES = 256 * 2**20  # cycle over at least this many weight bytes (H200 L2: 60 MB)
# Launch configs compared by --sweep, per format and row count. int8: the one-row CUDA-core
# kernel (block_m 1) against 16-row tl.dot tiles. int4 and fp8: those byte kernels (the
# defaults before the int32-word kernels) against the word kernels' tile shapes, num_warps
# and waves (programs per SM that split-K aims for), and the mma.sync kernels' (1-64 rows).
SWEEP_MAX_ERROR = 2e-2  # bf16 output rounding alone is ~4e-3
_OLD_SWEEP = {
    1: [LaunchConfig(1, bn, bk) for bn, bk in ((16, 256), (32, 256), (64, 128), (32, 512), (16, 512))]
       + [LaunchConfig(16, 64, 128)],
    4: [LaunchConfig(1, 32, 256), LaunchConfig(16, 64, 128), LaunchConfig(16, 128, 128)],
}
_INT4_FMA = [LaunchConfig(1, bn, bk, num_warps=nw, num_stages=1, waves=waves, words="fma")
             for bn, bk, nw, waves in ((256, 128, 4, 4), (256, 128, 4, 8), (128, 128, 4, 4), (128, 128, 4, 8),
                                       (128, 128, 2, 8), (64, 256, 4, 4), (128, 256, 4, 4), (128, 128, 4, 2),
                                       (32, 256, 4, 4), (64, 256, 4, 2), (128, 256, 4, 2), (64, 256, 8, 4))]
_INT4_DOT = [LaunchConfig(16, bn, bk, num_warps=nw, num_stages=stages, waves=waves, words="dot")
             for bn, bk, nw, stages, waves in ((128, 128, 4, 1, 2), (128, 128, 4, 1, 4), (64, 128, 4, 1, 4),
                                               (256, 128, 8, 1, 2), (128, 128, 4, 3, 2))]
# The mma.sync kernel (2-8 rows, and one row of wide linears): block_n = 16 x row tiles x num_warps.
_INT4_MMA = [LaunchConfig(8, bn, 256, num_warps=nw, num_stages=1, waves=waves, words="mma")
             for bn, nw, waves in ((128, 4, 2), (128, 4, 4), (64, 2, 4), (64, 4, 2), (256, 8, 2))]
# 9-32 rows on mma.sync: every A fragment meets 2-4 tiles of 8 x rows (more accumulators a
# thread, so also one 16-row tile a warp). At 64 rows (8 x tiles) these configs took
# 11.1-12.7 ms a step's linears against 8.5-8.7 for the tl.dot tiles (H200), so the sweep
# stops them at 32 rows.
_MMA_WIDE = ((128, 4, 2), (64, 2, 4), (32, 2, 4))
_INT4_DOT_64 = [LaunchConfig(64, bn, bk, num_warps=nw, num_stages=1, waves=2, words="dot")
                for bn, bk, nw in ((128, 128, 8), (256, 64, 8), (128, 64, 4), (64, 128, 4))]
_FP8_FMA = [LaunchConfig(1, bn, bk, num_warps=nw, num_stages=1, waves=waves, words="fma")
            for bn, bk, nw, waves in ((128, 256, 4, 4), (128, 256, 4, 8), (64, 256, 4, 4), (256, 256, 8, 4),
                                      (128, 128, 4, 4), (64, 512, 4, 4))]
# The fp8 mma.sync kernel (2-8 rows; timed at one row too): block_n = 16 x row tiles x num_warps,
# 128-wide K tiles.
_FP8_MMA = [LaunchConfig(8, bn, 128, num_warps=nw, num_stages=1, waves=waves, words="mma")
            for bn, nw, waves in ((128, 4, 2), (128, 4, 4), (64, 2, 4), (64, 4, 2), (256, 8, 2))]
_FP8_DOT = [LaunchConfig(16, bn, bk, num_warps=nw, num_stages=stages, waves=waves, words="dot")
            for bn, bk, nw, stages, waves in ((128, 128, 4, 1, 2), (128, 128, 4, 1, 4), (64, 128, 4, 1, 4),
                                              (128, 256, 8, 1, 2), (128, 128, 4, 3, 2))]


def _mma_wide(rows: int, block_k: int) -> list[LaunchConfig]:
    return [LaunchConfig(rows, bn, block_k, num_warps=nw, num_stages=1, waves=waves, words="mma")
            for bn, nw, waves in _MMA_WIDE]


SWEEP_CONFIGS = {
    "int8": _OLD_SWEEP,
    "fp8-triton": {
        1: [LaunchConfig(1, 32, 256), LaunchConfig(16, 64, 128), *_FP8_FMA, _FP8_DOT[0], *_FP8_MMA[:3]],
        4: [LaunchConfig(1, 32, 256), LaunchConfig(16, 64, 128), _FP8_FMA[0],
            LaunchConfig(4, 64, 256, num_stages=1, waves=4, words="fma"), *_FP8_DOT[:3], *_FP8_MMA],
        8: [LaunchConfig(16, 64, 128), *_FP8_DOT[:3], *_FP8_MMA],
        16: [LaunchConfig(16, 64, 128), *_FP8_DOT, *_mma_wide(16, 128)],
        32: [LaunchConfig(64, 128, 64), LaunchConfig(64, 64, 128), *_mma_wide(32, 128)],
        64: [LaunchConfig(64, 128, 64), LaunchConfig(64, 64, 128)],
    },
    "int4": {
        1: [LaunchConfig(16, 128, 128), LaunchConfig(1, 32, 256), *_INT4_FMA, *_INT4_DOT, *_INT4_MMA[:3]],
        4: [LaunchConfig(16, 128, 128), _INT4_FMA[0], LaunchConfig(4, 64, 128, num_stages=1, waves=4, words="fma"),
            *_INT4_DOT, *_INT4_MMA],
        8: [LaunchConfig(16, 128, 128), *_INT4_DOT[:3], *_INT4_MMA],
        16: [LaunchConfig(16, 128, 128), *_INT4_DOT, *_mma_wide(16, 256)],
        32: [_INT4_DOT_64[3], *_mma_wide(32, 256)],
        64: [LaunchConfig(64, 128, 64), *_INT4_DOT_64],
    },
}


@dataclass
class LinearTime:
    name: str
    out_features: int
    in_features: int
    rows: int
    fmt: str
    us: float
    floor_us: float  # bytes moved / copy bandwidth

    @property
    def of_floor(self) -> float:
        return self.floor_us / self.us


@functools.lru_cache(maxsize=None)
def _layers(fmt: str, n: int, k: int) -> list[nn.Module]:
    """Weight copies of one format and shape, built once per run."""
    copies = max(2, -(-L2_BYTES // (n * k * (2 if fmt == "bf16" else 1))))
    layers = []
    for seed in range(copies):
        torch.manual_seed(seed)
        layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        nn.init.normal_(layer.weight, std=0.02)
        if fmt.startswith("int8"):
            layer = Int8Linear(layer)
        elif fmt.startswith("int4"):
            layer = Int4Linear(*quantize_int4(layer.weight, 128), 128, None)
        elif fmt.startswith("fp8"):
            q, scale = quantize_fp8(layer.weight)
            layer = Fp8Linear(q, scale[:, None], None)
        layers.append(layer)
    return layers


def _call(fmt: str, layer: nn.Module, x: torch.Tensor, config: LaunchConfig | None) -> Callable[[], object]:
    if fmt == "bf16":
        return lambda: F.linear(x, layer.weight)
    if fmt.endswith("-dequant"):
        return lambda: layer.dense_matmul(x)
    if fmt == "fp8-scaled_mm":
        return lambda: layer._scaled_mm(x)
    if fmt == "fp8-w8a8":
        return lambda: layer._w8a8(x, decode_config(x.shape[0]))
    if isinstance(layer, Int4Linear):
        q = layer.qweight.view(layer.out_features, layer.in_features // 2)
        return lambda: weight_only_matmul(x, q, layer.scale, layer.minimum, layer.group_size, True, config)
    scale = layer.scale if isinstance(layer, Fp8Linear) else layer.scale[:, None]
    return lambda: weight_only_matmul(x, layer.qweight, scale, None, layer.in_features, False, config)


def _weight_bytes(layer: nn.Module) -> int:
    if isinstance(layer, QuantizedLinear):
        return layer.weight_bytes()
    return layer.weight.numel() * layer.weight.element_size()


def time_calls(calls: list[Callable[[], object]], repeats: int = 20) -> float:
    """Microseconds per call: a CUDA graph of `repeats` rounds over `calls`, replayed."""
    for call in calls:
        call()  # compiles, and settles lazy allocations outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for call in calls:
                call()
    return replay_us(graph, repeats * len(calls))


def _stored_format(fmt: str) -> str:
    return fmt.split("-")[0]


def measure(fmt: str, name: str, n: int, k: int, rows: int, bandwidth: float,
            config: LaunchConfig | None = None) -> LinearTime:
    layers = _layers(_stored_format(fmt), n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    us = time_calls([_call(fmt, layer, x, config) for layer in layers])
    moved = _weight_bytes(layers[0]) + 2 * rows * (n + k)
    return LinearTime(name, n, k, rows, fmt, us, moved / bandwidth * 1e6)


def relative_error(fmt: str, n: int, k: int, rows: int, config: LaunchConfig) -> float:
    """||y - x W^T|| / ||x W^T|| of one call against the layer's fp32 dequantized weight:
    a config that computes the wrong thing shows here, not in its time."""
    layer = _layers(_stored_format(fmt), n, k)[0]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.float(), layer.dequantize(torch.float32))
    return ((_call(fmt, layer, x, config)().float() - expected).norm() / expected.norm()).item()


def config_label(config: LaunchConfig) -> str:
    kind = f"words-{config.words}" if config.words else ("gemv" if config.block_m == 1 else "dot")
    return (f"{kind} {config.block_m}x{config.block_n}x{config.block_k} warps{config.num_warps} "
            f"stages{config.num_stages} waves{config.waves}")


def _sweep_entry(fmt: str, t: LinearTime, config: LaunchConfig | None = None, error: float | None = None) -> dict:
    entry = {"fmt": fmt, "shape": t.name, "n": t.out_features, "k": t.in_features, "rows": t.rows,
             "us": t.us, "floor_us": t.floor_us}
    if config is None:
        return entry
    return {**asdict(config), "label": config_label(config), **entry, "relative_error": error}


def _sweep_cell(config: LaunchConfig, t: LinearTime, error: float) -> str:
    wrong = f" WRONG: relative error {error:.1e}" if error > SWEEP_MAX_ERROR else ""
    return f"[{config_label(config)}] {t.us:.1f} ({t.of_floor:.0%}){wrong}"


def sweep(bandwidth: float, formats: list[str], row_counts: list[int]) -> list[dict]:
    """Every sweep config of each format at the given row counts (those the sweep has
    configs for) on the engine's linears, bf16 beside them; prints each (format, rows)
    ranking per step's linears, fastest first."""
    results = []
    for fmt in formats:
        for rows, configs in SWEEP_CONFIGS[fmt].items():
            if rows not in row_counts:
                continue
            step_us = {"bf16 cuBLAS": 0.0} | {config_label(c): 0.0 for c in configs}
            floor_us = 0.0
            for name, n, k in LLAMA3_8B_ENGINE_LINEARS:
                bf16 = measure("bf16", name, n, k, rows, bandwidth)
                timed = [(c, measure(fmt, name, n, k, rows, bandwidth, c), relative_error(fmt, n, k, rows, c))
                         for c in configs]
                results += [_sweep_entry("bf16", bf16)] + [_sweep_entry(fmt, t, c, e) for c, t, e in timed]
                step_us["bf16 cuBLAS"] += bf16.us
                for config, t, _ in timed:
                    step_us[config_label(config)] += t.us
                floor_us += timed[0][1].floor_us
                print(f"sweep {fmt} {name} {n}x{k} M={rows}: bf16 {bf16.us:.1f}, "
                      + ", ".join(_sweep_cell(*entry) for entry in timed), flush=True)
            print(f"sweep {fmt} M={rows}: one step's linears, fastest first (ms, x{LLAMA3_8B_LAYERS} layers; "
                  f"{fmt} floor {LLAMA3_8B_LAYERS * floor_us / 1e3:.2f} ms):")
            for label, us in sorted(step_us.items(), key=lambda item: item[1]):
                print(f"  {LLAMA3_8B_LAYERS * us / 1e3:6.2f} ms ({floor_us / us:4.0%} of the {fmt} floor)  {label}")
    return results


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,16", help="Comma-separated row counts (batch of tokens).")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"Comma-separated, of {', '.join(FORMATS)} (default: all).")
    parser.add_argument("--sweep", action="store_true",
                        help="Also time some of the Triton kernels' launch configs (at the --rows counts it has "
                             "configs for).")
    parser.add_argument("--sweep-formats", default=",".join(SWEEP_FORMATS),
                        help=f"Comma-separated formats --sweep times, of {', '.join(SWEEP_FORMATS)}.")
    parser.add_argument("--output-json", default=None, help="Write the results to this file.")


def run_from_args(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("bench quantized-linears needs a CUDA device")
    rows_list = [int(r) for r in args.rows.split(",")]
    formats, sweep_formats = args.formats.split(","), args.sweep_formats.split(",")
    bandwidth = copy_bandwidth(torch.device("cuda"))  # bytes read + written per second
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    if torch.cuda.get_device_capability() < (8, 9):
        formats = [f for f in formats if not f.startswith("fp8")]
        sweep_formats = [f for f in sweep_formats if not f.startswith("fp8")]
    results = [measure(fmt, name, n, k, rows, bandwidth)
               for rows in rows_list for name, n, k in LLAMA3_8B_LINEARS for fmt in formats]
    print(f"\n| rows | linear | {' | '.join(formats)} |")
    print(f"|---:|---|{'---:|' * len(formats)}")
    for rows in rows_list:
        for name, n, k in [*LLAMA3_8B_LINEARS, ("layer", 0, 0)]:
            cells = []
            for fmt in formats:
                picked = [r for r in results if r.rows == rows and r.fmt == fmt and (name == "layer" or r.name == name)]
                us, floor = sum(r.us for r in picked), sum(r.floor_us for r in picked)
                cells.append(f"{us:.1f} ({floor / us:.0%})")
            label = f"{name} {n}x{k}" if n else f"one layer (x{LLAMA3_8B_LAYERS} = step)"
            print(f"| {rows} | {label} | {' | '.join(cells)} |")
    print("\ncells: microseconds per call (floor / measured)")
    for rows in rows_list:
        step = {fmt: LLAMA3_8B_LAYERS * sum(r.us for r in results if r.rows == rows and r.fmt == fmt) / 1e3
                for fmt in formats}
        print(f"rows {rows}: linears of one llama3-8b step (ms): "
              + ", ".join(f"{fmt} {ms:.2f}" for fmt, ms in step.items()))
    sweep_results = sweep(bandwidth, sweep_formats, rows_list) if args.sweep else []
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth_bytes_per_s": bandwidth,
                       "results": [{**asdict(r), "of_floor": r.of_floor} for r in results],
                       "sweep": sweep_results}, f, indent=1)
    return 0
