import torch, time, statistics
from kvserve.cpu_kernels import int4_matmul_op
torch.set_num_threads(2)
op = int4_matmul_op()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
def make(n, k, g=32):
    return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // g), torch.rand(n, k // g)
layers32 = [[make(n, k) for n, k in shapes] for _ in range(30)]
layers16 = [[(q, s.half(), m.half()) for q, s, m in l] for l in layers32]
for rows in (1, 4):
    x1 = torch.randn(rows, 576); x2 = torch.randn(rows, 1536)
    def step(layers):
        for l in layers:
            for (q, s, m), (n, k) in zip(l, shapes):
                op(x1 if k == 576 else x2, q, s, m, 32)
    for L in (layers32, layers16): step(L); step(L)
    a, b = [], []
    for _ in range(15):
        t = time.perf_counter(); step(layers32); a.append(time.perf_counter() - t)
        t = time.perf_counter(); step(layers16); b.append(time.perf_counter() - t)
    print(f"rows {rows}: 120 calls over 30 layers (cold), ms: fp32 scales median {statistics.median(a)*1e3:.2f} min {min(a)*1e3:.2f}; "
          f"fp16 median {statistics.median(b)*1e3:.2f} min {min(b)*1e3:.2f}; ratio of medians {statistics.median(a)/statistics.median(b):.3f}")
