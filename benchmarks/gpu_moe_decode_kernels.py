"""A mixture-of-experts decode step's small kernels at one token, each alone, timed as CUDA-graph
replays of 20 calls (benchmarks/gpu_moe_gemv_sweep.py's time_us), bf16 on random weights:

* the router (ops/moe_routing.py route_hidden) against its launch grid's options (rows a
  program, warps, tile width), 128 x 2048 (Qwen3-30B-A3B) and 8 x 4096 (Mixtral-8x7B);
* the pair GEMVs' tiles (ops/fused_moe_gemv.py): gate/up, the down GEMV into partials (then
  a combine) and the down GEMV that sums each token's choices itself;
* that summing GEMV with one choice as a dense GEMV against cuBLAS, for the attention
  projections of Qwen3-30B-A3B and Llama-3-8B (whether kvserve should take them over).

    PYTHONPATH=. python benchmarks/gpu_moe_decode_kernels.py
"""
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, "benchmarks")
from gpu_moe_gemv_sweep import time_us
from kvserve.ops.expert_weights import ExpertWeights
from kvserve.ops import fused_moe_gemv as g
from kvserve.ops import moe_routing as r
from kvserve.ops.split_k import split_counters

torch.manual_seed(0)
dt = torch.bfloat16
print(torch.cuda.get_device_name())
# --- router
for E, H, K in ((128, 2048, 8), (8, 4096, 2)):
    x = torch.randn(1, H, device="cuda", dtype=dt)
    w = torch.randn(E, H, device="cuda", dtype=dt) / H**0.5
    ref_ids, ref_w, _ = r.route(F.linear(x, w), K, True)
    base = time_us(lambda: r.route_hidden(x, w, K, True))
    print(f"router E={E} H={H}: route_hidden {base:.2f} us; linear+route {time_us(lambda: r.route(F.linear(x, w), K, True)):.2f} us")
    counters = split_counters(x.device)
    block_e = triton.next_power_of_2(E)
    for rows in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4):
            for block_h in (256, 512, 1024, 2048):
                ids = torch.empty(1, K, dtype=torch.int32, device="cuda")
                wts = torch.empty(1, K, dtype=torch.float32, device="cuda")
                logits = torch.empty(1, E, dtype=dt, device="cuda")
                def call():
                    r._gate_and_route_kernel[(1, triton.cdiv(E, rows))](
                        x, w, w, logits, counters, ids, wts, logits, wts, E, H, x.stride(0), w.stride(0), 1, 0.0,
                        TOP_K=K, RENORMALIZE=True, HAS_SHARED=False, ROWS=rows, BLOCK_H=block_h, BLOCK_E=block_e,
                        BLOCK_K=triton.next_power_of_2(K), num_warps=warps, PDL=False, ROW_SCALE=False,
                        PARTIALS=1)
                try:
                    us = time_us(call)
                except Exception as e:
                    print(f"  rows {rows} warps {warps} block_h {block_h}: {type(e).__name__}")
                    continue
                ok = torch.equal(ids.long().sort().values, ref_ids.long().sort().values)
                print(f"  rows {rows:2d} warps {warps} block_h {block_h:4d}: {us:6.2f} us {'ok' if ok else 'WRONG'}")
# --- experts: gate/up tiles, down split+combine vs summed
for name, (E, K, H, I) in {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}.items():
    w13 = ExpertWeights(torch.randn(E, 2 * I, H, device="cuda", dtype=dt) / H**0.5)
    w2 = ExpertWeights(torch.randn(E, H, I, device="cuda", dtype=dt) / I**0.5)
    x = torch.randn(1, H, device="cuda", dtype=dt)
    chosen = torch.randperm(E, device="cuda")[:K].int()[None]
    weights = torch.softmax(torch.randn(1, K, device="cuda"), -1)
    flat = chosen.reshape(-1)
    gb13 = K * 2 * I * H * 2 / 1e3
    gb2 = K * I * H * 2 / 1e3
    act = torch.empty(K, I, device="cuda", dtype=dt)
    ref = g.experts_gemv(x, chosen, weights, w13, w2, summed_down=False).float()
    print(f"{name}: default experts_gemv split {time_us(lambda: g.experts_gemv(x, chosen, weights, w13, w2, summed_down=False)):.2f} us, summed {time_us(lambda: g.experts_gemv(x, chosen, weights, w13, w2, summed_down=True)):.2f} us")
    for tile in [g.GemvTile(*t) for t in ((16, 256, 4), (8, 256, 4), (8, 512, 4), (32, 256, 4), (16, 512, 4), (16, 128, 4), (4, 512, 4), (8, 256, 2), (16, 256, 8))]:
        us13 = time_us(lambda: g._launch(x, w13, act, flat, I, K, True, 1, H, tile))
        splits = g.down_splits(K, H, I, tile, x.device)
        kps = triton.cdiv(triton.cdiv(I, tile.block_k), splits) * tile.block_k
        splits = triton.cdiv(I, kps)
        part = torch.empty(splits, K, H, device="cuda", dtype=torch.float32)
        us2 = time_us(lambda: g._launch(act, w2, part, flat, H, 1, False, splits, kps, tile))
        out = torch.empty(1, H, device="cuda", dtype=dt)
        us2s = time_us(lambda: g._launch_summed(act, w2, out, flat, weights, tile, None))
        full = time_us(lambda: g.experts_gemv(x, chosen, weights, w13, w2, tile, tile, summed_down=True))
        err = (g.experts_gemv(x, chosen, weights, w13, w2, tile, tile, summed_down=True).float() - ref).abs().max().item()
        print(f"  tile {tuple(tile)}: gate/up {us13:6.2f} us ({gb13/us13:5.0f} GB/s); down {splits} splits {us2:6.2f} us;"
              f" summed down {us2s:6.2f} us ({gb2/us2s:5.0f} GB/s); summed total {full:6.2f} us (err {err:.1e})")
# --- dense GEMV vs cuBLAS: qwen3 qkv, o; llama3-8b qkv, o, gate_up, down
one = torch.zeros(1, dtype=torch.int32, device="cuda")
unit = torch.ones(1, 1, device="cuda")
for N, Kd in ((5120, 2048), (2048, 4096), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
    w = torch.randn(N, Kd, device="cuda", dtype=dt) / Kd**0.5
    x = torch.randn(1, Kd, device="cuda", dtype=dt)
    gb = N * Kd * 2 / 1e3
    cub = time_us(lambda: F.linear(x, w))
    line = f"dense {N}x{Kd}: cuBLAS {cub:6.2f} us ({gb/cub:5.0f} GB/s)"
    ew = ExpertWeights(w[None])
    out = torch.empty(1, N, device="cuda", dtype=dt)
    for tile in [g.GemvTile(*t) for t in ((8, 256, 4), (8, 512, 4), (16, 256, 4), (4, 512, 4), (4, 1024, 4), (16, 512, 8))]:
        us = time_us(lambda: g._launch_summed(x, ew, out, one, unit, tile, None))
        err = (out.float() - F.linear(x.float(), w.float())).abs().max().item()
        line += f"; {tuple(tile)} {us:6.2f} ({gb/us:5.0f}, err {err:.0e})"
    print(line)
