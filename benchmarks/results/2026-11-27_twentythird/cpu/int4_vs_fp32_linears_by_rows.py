import torch, time, statistics
from kvserve.cpu_kernels import int4_matmul_op
torch.set_num_threads(2)
op = int4_matmul_op()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
L4 = [[(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // 32), torch.rand(n, k // 32)) for n, k in shapes] for _ in range(30)]
LF = [[torch.randn(n, k) for n, k in shapes] for _ in range(30)]
for rows in (4, 8, 12, 16):
    xs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
    def int4():
        for l in L4:
            for (q, s, m), (n, k) in zip(l, shapes): op(xs[k], q, s, m, 32)
    def fp32():
        for l in LF:
            for w, (n, k) in zip(l, shapes): torch.mm(xs[k], w.t())
    int4(); fp32()
    a, b = [], []
    for _ in range(7):
        t = time.perf_counter(); int4(); a.append(time.perf_counter() - t)
        t = time.perf_counter(); fp32(); b.append(time.perf_counter() - t)
    print(f"rows {rows}: a step's linears, int4 kernel {statistics.median(a)*1e3:.1f} ms, fp32 mm {statistics.median(b)*1e3:.1f} ms")
