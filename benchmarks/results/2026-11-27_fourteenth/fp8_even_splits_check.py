import torch
from kvserve.quantization.fp8 import quantize_fp8
from kvserve.quantization.weight_only import LaunchConfig, weight_only_matmul
torch.manual_seed(0)
for n, k in ((4096, 14336), (6144, 4096), (200, 4096)):
    w = torch.randn(n, k, device="cuda") * 0.05
    q, scale = quantize_fp8(w)
    scale = scale[:, None]
    ref = (q.double() * scale.double())
    for rows in (1, 3):
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        r = x.double() @ ref.T
        for cfg in (None, LaunchConfig(8, 128, 128, num_warps=4, num_stages=1, split_k=6, words="mma", even_splits=True),
                    LaunchConfig(8, 128, 128, num_warps=4, num_stages=1, waves=6, words="mma", even_splits=True)):
            y = weight_only_matmul(x, q, scale, None, k, config=cfg).double()
            err = ((y - r).norm(dim=1) / r.norm(dim=1)).max().item()
            print(n, k, rows, cfg and (cfg.split_k, cfg.even_splits), f"{err:.2e}", "OK" if err < 1e-2 else "BAD", flush=True)
