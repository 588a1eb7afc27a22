"""The int4 one-row linears with and without the fused RMSNorm (PendingNorm), us a call: each
in a CUDA graph over enough weight copies that none stays in L2 (llama3-8b shapes, bf16 x).
qkv and gate/up finish a pending norm (32 partial sums), o and down leave one.

    python benchmarks/gpu_fused_norm_kernels.py
"""

from __future__ import annotations

import sys
import os

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_one_row_configs import graph_us, weights  # noqa: E402

from kvserve.model_executor.layers.layernorm import PendingNorm  # noqa: E402
from kvserve.quantization.weight_only.matmul import (  # noqa: E402
    AddNorm,
    weight_only_matmul,
    weight_only_matmul_add_norm,
)

MIN_BYTES = 256 << 20
# name: (N, K, role)
SHAPES = {"qkv": (6144, 4096, "pending"), "o": (4096, 4096, "add_norm"),
          "gate_up": (28672, 4096, "pending"), "down": (4096, 14336, "add_norm")}


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "one row, us a call (CUDA graph over weight copies)")
    residual = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    sums = torch.rand(1, 32, device="cuda") * 100
    for name, (n, k, role) in SHAPES.items():
        stored = weights("int4", n, k, max(2, -(-MIN_BYTES // (n * k // 2))))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        plain = graph_us([lambda s=s: weight_only_matmul(x, *s) for s in stored])
        if role == "pending":
            fused = graph_us([lambda s=s: weight_only_matmul(x, *s, pending=PendingNorm(x, sums, 1e-5)) for s in stored])
        else:
            fused = graph_us([lambda s=s: weight_only_matmul_add_norm(x, *s[:4], AddNorm(residual, norm_weight),
                                                                      four_bit=True) for s in stored])
        print(f"{name:8s} ({role:8s}): plain {plain:7.2f}  fused {fused:7.2f}", flush=True)


if __name__ == "__main__":
    main()
