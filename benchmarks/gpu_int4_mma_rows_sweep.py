"""int4-g128 linears at 9-16 decode rows (two 8-row tiles of x on mma.sync): launch configs
of the mma kernel against the default (configs.INT4_DECODE_CONFIGS), llama3-8b's four
linears, each call on its own weight copy (8 copies, more bytes than L2), 32 calls (a step's
layers) captured in one CUDA graph (gpu_one_row_configs.graph_us); outputs checked against
the fp64 product of the dequantized weights. GPU only:
python benchmarks/gpu_int4_mma_rows_sweep.py [--rows 9,12,16]"""

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
    parser.add_argument("--rows", default="9,12,16", help="Comma-separated row counts.")
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
        default_step, per_config = 0.0, [0.0] * len(CONFIGS)
        for name, (copies, weight) in layers.items():
            x = torch.randn(m, weight.shape[1], device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ weight.t()
            rounds = copies * (LAYERS // COPIES)
            default = graph_us([lambda c=c: weight_only_matmul(x, *c, 128, four_bit=True) for c in rounds])
            default_step += default
            results = []
            for i, config in enumerate(CONFIGS):
                y = weight_only_matmul(x, *copies[0], 128, four_bit=True, config=config)
                assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2, (name, m, config)
                t = graph_us([lambda c=c, config=config: weight_only_matmul(x, *c, 128, four_bit=True, config=config)
                              for c in rounds])
                per_config[i] += t
                results.append((t, config))
            results.sort(key=lambda r: r[0])
            t, best = results[0]
            print(f"rows {m:2d} {name:8s} default {default:6.1f} us | best {t:6.1f} (block_n {best.block_n} "
                  f"warps {best.num_warps} waves {best.waves})", flush=True)
        print(f"rows {m:2d} step: default {default_step * LAYERS / 1e3:.2f} ms ({default_config(m, True, False)}); "
              "every config, fastest first:", flush=True)
        for i in sorted(range(len(CONFIGS)), key=per_config.__getitem__):
            c = CONFIGS[i]
            print(f"  {per_config[i] * LAYERS / 1e3:.2f} ms  block_n {c.block_n:3d} warps {c.num_warps} waves {c.waves}",
                  flush=True)


if __name__ == "__main__":
    main()
