"""int4-g128 linears at 2-32 decode rows on mma.sync: launch configs of the mma kernel against
the default (configs.INT4_DECODE_CONFIGS), llama3-8b's four linears, each call on its own
weight copy (8 copies, more bytes than L2), 32 calls (a step's layers) captured in one CUDA
graph (gpu_one_row_configs.graph_us); outputs checked against the fp64 product of the
dequantized weights. Prints every config's time per linear, the step's linears per config,
and the step with gate/up (the wide linear) and the three narrow ones each on their own best
config. GPU only:
python benchmarks/gpu_int4_mma_rows_sweep.py [--rows 5,8,9,12,16]"""

from __future__ import annotations

import argparse
import itertools

import torch

from gpu_one_row_configs import graph_us  # benchmarks/ is the script's directory
from kvserve.quantization.int4 import _pack_nibbles, dequantize_int4, quantize_int4
from kvserve.quantization.weight_only import LaunchConfig, default_config, weight_only_matmul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
COPIES = 8
# block_n = 16 x row tiles x warps; all rows in one program (block_m 16: two x tiles).
CONFIGS = [LaunchConfig(16, 16 * row_tiles * warps, 256, num_warps=warps, num_stages=1, waves=waves, words="mma")
           for row_tiles, warps, waves in itertools.product((1, 2, 4), (2, 4), (1, 2, 4))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="5,8,9,12,16", help="Comma-separated row counts.")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = {}
    for name, (n, k) in SHAPES.items():
        q, scale, minimum = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128)
        scale, minimum = scale.half(), minimum.half()
        packed = _pack_nibbles(q).view(n, k // 2)
        layers[name] = ([(packed.clone(), scale.clone(), minimum.clone()) for _ in range(COPIES)],
                        dequantize_int4(q, scale.float(), minimum.float()).double())
    print(torch.cuda.get_device_name(), "| us a call; step = 32 layers x 4 linears, ms")
    for m in (int(r) for r in args.rows.split(",")):
        default = {}
        times = {}  # (linear, config index) -> us a call
        for name, (copies, weight) in layers.items():
            x = torch.randn(m, weight.shape[1], device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ weight.t()
            rounds = copies * (LAYERS // COPIES)
            default[name] = graph_us([lambda c=c: weight_only_matmul(x, *c, 128, four_bit=True) for c in rounds])
            for i, config in enumerate(CONFIGS):
                y = weight_only_matmul(x, *copies[0], 128, four_bit=True, config=config)
                assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2, (name, m, config)
                times[name, i] = graph_us([lambda c=c, config=config: weight_only_matmul(
                    x, *c, 128, four_bit=True, config=config) for c in rounds])
        step = {i: sum(times[name, i] for name in SHAPES) * LAYERS / 1e3 for i in range(len(CONFIGS))}
        print(f"rows {m:2d}: default {sum(default.values()) * LAYERS / 1e3:.2f} ms a step's linears "
              f"({default_config(m, True, False)}); every config, fastest first, us a call:", flush=True)
        print("     step ms  config                     " + "".join(f"{name:>9s}" for name in SHAPES))
        print("        -     default                    " + "".join(f"{default[name]:9.1f}" for name in SHAPES))
        for i in sorted(step, key=step.__getitem__):
            print(f"  {step[i]:7.2f}  {label(CONFIGS[i]):26s} " + "".join(f"{times[name, i]:9.1f}" for name in SHAPES))
        narrow = [name for name in SHAPES if name != "gate_up"]
        best_narrow = min(range(len(CONFIGS)), key=lambda i: sum(times[name, i] for name in narrow))
        best_wide = min(range(len(CONFIGS)), key=lambda i: times["gate_up", i])
        routed = (sum(times[name, best_narrow] for name in narrow) + times["gate_up", best_wide]) * LAYERS / 1e3
        each = sum(min(times[name, i] for i in range(len(CONFIGS))) for name in SHAPES) * LAYERS / 1e3
        print(f"rows {m:2d}: routed {routed:.2f} ms (narrow: {label(CONFIGS[best_narrow])}; gate_up: "
              f"{label(CONFIGS[best_wide])}); each linear's best {each:.2f} ms", flush=True)


def label(config: LaunchConfig) -> str:
    return f"block_n {config.block_n:3d} warps {config.num_warps} waves {config.waves}"


if __name__ == "__main__":
    main()
