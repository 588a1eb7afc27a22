"""int4 (or grouped int8) linears at many rows (prefill chunks, wide decode batches) on the
GPU: one llama3-8b step's linears (32 layers of q/k/v, o, gate/up, down as the engine fuses
them), ms, for bf16 cuBLAS, the dense path as it was (torch dequantize in fp32, then cuBLAS),
the dense path on `unpack_weight` (one Triton pass to bf16, then cuBLAS), and for int4 the
Triton tl.dot kernel that reads the packed weight as int32 words (`weight_only_matmul`) under
a few launch configs. Each output is checked against cuBLAS on the dequantized weight. CUDA
graphs of back-to-back calls over weight copies that do not fit L2, as `kvserve bench
quantized-linears` does. `--format int8`: GroupInt8Linear with 32-wide groups and no offset,
as GGUF Q8_0 loads.

    python benchmarks/gpu_int4_many_rows.py --rows 64,128,256,512,2048 [--format int8]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from kvserve.benchmarks.quantized_linears import LLAMA3_8B_ENGINE_LINEARS, LLAMA3_8B_LAYERS
from kvserve.quantization.int4 import Int4Linear, quantize_int4
from kvserve.quantization.int8 import GroupInt8Linear
from kvserve.quantization.weight_only import LaunchConfig, unpack_weight, weight_only_matmul

# The word kernel's tl.dot tiles (the engine's 17-64 row config, and taller ones); the byte
# kernel (`_weight_only_matmul_kernel`) measured 15-20x slower than cuBLAS here and is left out.
CONFIGS = [LaunchConfig(bm, 64, 128, num_warps=nw, num_stages=1, waves=2, words="dot")
           for bm, nw in ((64, 4), (128, 4), (128, 8))]


def graph_ms(fn, copies: int, reps: int = 5) -> float:
    """Median ms of one call, over a CUDA graph of `copies` calls replayed `reps` times."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,128,256,512,2048")
    parser.add_argument("--format", default="int4", choices=("int4", "int8"))
    args = parser.parse_args()
    torch.manual_seed(0)
    per_step: dict[tuple[str, int], float] = {}
    for name, n, k in LLAMA3_8B_ENGINE_LINEARS:
        copies = 4
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        if args.format == "int4":
            layers = [Int4Linear(*quantize_int4(w, 128), 128, None) for w in weights]
            packed = [layer.qweight.view(n, k // 2) for layer in layers]
            offsets = [layer.minimum for layer in layers]
            group_size = 128
        else:
            group_size = 32
            scales = [w.float().reshape(n, -1, group_size).abs().amax(-1) / 127 for w in weights]
            layers = [GroupInt8Linear(torch.round(w.float().reshape(n, -1, group_size) / s[..., None]).reshape(n, k)
                                      .to(torch.int8), s, None, group_size, None) for w, s in zip(weights, scales)]
            packed = [layer.qweight for layer in layers]
            offsets = [None] * copies
        dense = [layer.dequantize(torch.bfloat16) for layer in layers]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = F.linear(x, dense[0]).float()
            variants = {
                "bf16 cuBLAS": lambda i: F.linear(x, weights[i]),
                "dequant torch + cuBLAS": lambda i: F.linear(x, layers[i].dequantize(torch.bfloat16)),
                "unpack_weight + cuBLAS": lambda i: F.linear(x, unpack_weight(
                    packed[i], layers[i].scale, offsets[i], group_size, torch.bfloat16, args.format == "int4")),
            }
            for config in CONFIGS if args.format == "int4" else ():
                variants[f"words-dot {config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps}"] = (
                    lambda i, c=config: weight_only_matmul(x, packed[i], layers[i].scale, layers[i].minimum,
                                                           128, True, c))
            for label, fn in variants.items():
                if not label.startswith("bf16"):
                    error = ((fn(0).float() - reference).abs().max() / reference.abs().max()).item()
                    assert error < 2e-2, f"{label} {name} rows {m}: error {error:.2e}"
                ms = graph_ms(fn, copies)
                per_step[(label, m)] = per_step.get((label, m), 0.0) + ms * LLAMA3_8B_LAYERS
    rows = sorted({m for _, m in per_step})
    labels = list(dict.fromkeys(label for label, _ in per_step))
    print("one llama3-8b step's linears, ms")
    print(f"{'variant':34s}" + "".join(f"{m:>10d}" for m in rows))
    for label in labels:
        print(f"{label:34s}" + "".join(f"{per_step[(label, m)]:10.2f}" for m in rows))


if __name__ == "__main__":
    main()
