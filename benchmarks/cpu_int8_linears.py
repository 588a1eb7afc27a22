"""One SmolLM2 decode step's linears (qkv, o, gate_up, down; 30 layers, each layer its own
weights so they stream from memory as in a step) at 1, 4 and 16 rows: fp32 F.linear,
torch's `_weight_int8pack_mm` (bf16 activations) and kvserve's int8 kernel.

    python benchmarks/cpu_int8_linears.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.benchmarks.cpu_linears import SMOLLM2_LAYERS, SMOLLM2_LINEARS, step_ms
from kvserve.cpu_kernels import int8_matmul_op
from kvserve.quantization.int8 import quantize_int8


def main() -> None:
    own = int8_matmul_op()
    torch.manual_seed(0)
    for rows in (1, 4, 16):
        calls: dict[str, list[Callable[[], torch.Tensor]]] = {"fp32": [], "torch int8": [], "kvserve int8": []}
        for n, k in SMOLLM2_LINEARS:
            x = torch.randn(rows, k)
            for _ in range(SMOLLM2_LAYERS):
                weight = torch.randn(n, k)
                q, scale = quantize_int8(weight)
                bf16_scale = scale.to(torch.bfloat16)
                calls["fp32"].append(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
                calls["torch int8"].append(
                    lambda x=x, q=q, s=bf16_scale: torch._weight_int8pack_mm(x.to(torch.bfloat16), q, s).float())
                if own is not None:
                    calls["kvserve int8"].append(lambda x=x, q=q, s=scale: own(x, q, s))
        times = {name: f"{step_ms(c, rounds=20):.2f} ms" for name, c in calls.items() if c}
        print(f"{rows} rows, one step's linears: {times}")


if __name__ == "__main__":
    main()
