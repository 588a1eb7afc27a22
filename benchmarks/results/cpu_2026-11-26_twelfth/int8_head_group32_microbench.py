import time, torch
from kvserve.cpu_kernels import int8_matmul_op
op = int8_matmul_op()
n, k = 49152, 576
q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
s1 = torch.rand(n)
s32 = torch.rand(n, k // 32)
def t(f, reps=80):
    f(); f()
    ts = []
    for _ in range(reps):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    ts.sort(); return ts[len(ts)//2] * 1e3
for rows in (1, 4):
    x = torch.randn(rows, k)
    for name, s in (("per-channel", s1), ("group32", s32)):
        print(rows, name, f"{t(lambda: op(x, q, s)):.3f} ms")
