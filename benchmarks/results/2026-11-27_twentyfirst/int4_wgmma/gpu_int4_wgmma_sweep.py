"""int4-g128 linears at 2-16 decode rows: the swap_ab tl.dot kernel (int4_wgmma) over a grid
of tiles against what runs there now (the mma.sync kernel, default_config), llama3-8b's four
linears, each output checked against the fp64 product of the dequantized weights. Per row
count: us a call for each linear and the step's 32 layers (ms). GPU only:
python benchmarks/gpu_int4_wgmma_sweep.py [--rows 2,4,8,16]"""

from __future__ import annotations

import argparse
import itertools

import torch

from kvserve.quantization.int4 import _pack_nibbles, dequantize_int4, quantize_int4
from kvserve.quantization.weight_only import LaunchConfig, weight_only_matmul
from kvserve.quantization.weight_only.int4_wgmma import int4_wgmma_matmul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
COPIES = 8  # distinct weights per linear, more bytes than L2 holds; each called 4 times a graph
REPLAYS = 10
CONFIGS = [LaunchConfig(16, n, k, num_warps=w, num_stages=s, waves=waves)
           for n, k, w, s, waves in itertools.product((64, 128), (64, 128), (4,), (3, 4), (1, 2, 4))]


def us(calls) -> float:
    """us a call of `calls` (a list of closures, each on its own copy of the weight so that
    none comes from L2), captured in one CUDA graph as a step would run them."""
    for call in calls:
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,4,8,16", help="Comma-separated row counts.")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = {}
    for name, (n, k) in SHAPES.items():
        q, scale, minimum = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128)
        scale, minimum = scale.half(), minimum.half()
        packed = _pack_nibbles(q).view(n, k // 2)
        copies = [(packed.clone(), scale.clone(), minimum.clone()) for _ in range(COPIES)]
        layers[name] = (copies, dequantize_int4(q, scale.float(), minimum.float()).double())
    print(torch.cuda.get_device_name(), "| us per call; step = 32 layers x 4 linears, ms")
    for m in (int(r) for r in args.rows.split(",")):
        mma_step, best_step, per_config = 0.0, 0.0, {i: 0.0 for i in range(len(CONFIGS))}
        for name, (copies, weight) in layers.items():
            x = torch.randn(m, weight.shape[1], device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ weight.t()
            rounds = copies * (LAYERS // COPIES)
            mma = us([lambda c=c: weight_only_matmul(x, *c, 128, four_bit=True) for c in rounds])
            results = []
            for i, config in enumerate(CONFIGS):
                y = int4_wgmma_matmul(x, *copies[0], 128, config)
                error = ((y.double() - ref).norm() / ref.norm()).item()
                assert error < 1e-2, (name, m, config, error)
                t = us([lambda c=c, config=config: int4_wgmma_matmul(x, *c, 128, config) for c in rounds])
                per_config[i] += t
                results.append((t, config))
            results.sort(key=lambda r: r[0])
            mma_step += mma
            best_step += results[0][0]
            best = results[0][1]
            print(f"rows {m:2d} {name:8s} mma.sync {mma:7.1f} us | best {results[0][0]:7.1f} us "
                  f"(n {best.block_n} k {best.block_k} stages {best.num_stages} waves {best.waves}) "
                  f"| second {results[1][0]:7.1f}", flush=True)
        one = min(per_config, key=per_config.get)
        c = CONFIGS[one]
        print(f"rows {m:2d} step: mma.sync {mma_step * LAYERS / 1e3:.2f} ms, each linear's best "
              f"{best_step * LAYERS / 1e3:.2f}, one config for all {per_config[one] * LAYERS / 1e3:.2f} "
              f"(n {c.block_n} k {c.block_k} stages {c.num_stages} waves {c.waves})", flush=True)


if __name__ == "__main__":
    main()
