"""One SmolLM2 decode step's linears (qkv, o, gate_up, down; 30 layers, each layer its own
weights so they stream from memory as in a step) at 1-16 rows: kvserve's fp32 kernel,
torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations), kvserve's int4 kernel
(group 32, as the embedded Q4_1 model) and kvserve's int8 kernel, ms a step.

    python benchmarks/cpu_int4_linears.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.benchmarks.cpu_linears import SMOLLM2_LAYERS, SMOLLM2_LINEARS, step_ms
from kvserve.cpu_kernels import float_matmul_op, int4_matmul_op, int8_matmul_op
from kvserve.quantization import int4
from kvserve.quantization.int8 import quantize_int8

GROUP = 32  # as the embedded Q4_1 model


def main() -> None:
    fp32, own_int4, own_int8 = float_matmul_op(), int4_matmul_op(), int8_matmul_op()
    op = int4.int4_matmul_op
    int4.int4_matmul_op = lambda: None  # layers in torch's int4 kernel layout
    torch.manual_seed(0)
    try:
        for rows in (1, 2, 4, 8, 16):
            calls: dict[str, list[Callable[[], torch.Tensor]]] = {
                "fp32": [], "torch int4": [], "kvserve int4": [], "kvserve int8": []}
            for n, k in SMOLLM2_LINEARS:
                x = torch.randn(rows, k)
                for _ in range(SMOLLM2_LAYERS):
                    weight = torch.randn(n, k)
                    q, scale, minimum = int4.quantize_int4(weight, GROUP)
                    torch_layer = int4.Int4Linear(q, scale, minimum, GROUP, None)
                    pairs = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
                    q8, scale8 = quantize_int8(weight)
                    calls["fp32"].append(lambda x=x, w=weight: fp32(x, w))
                    calls["torch int4"].append(lambda x=x, layer=torch_layer: layer.kernel_matmul(x))
                    calls["kvserve int4"].append(lambda x=x, p=pairs, s=scale, m=minimum: own_int4(x, p, s, m, GROUP))
                    calls["kvserve int8"].append(lambda x=x, q=q8, s=scale8: own_int8(x, q, s))
            print(f"{rows:2d} rows: " + ", ".join(f"{name} {step_ms(c):.2f}" for name, c in calls.items()), flush=True)
    finally:
        int4.int4_matmul_op = op


if __name__ == "__main__":
    main()
