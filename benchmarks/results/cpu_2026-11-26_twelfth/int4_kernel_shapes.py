import time, torch
from kvserve.cpu_kernels import int4_matmul_op
from kvserve.quantization.int4 import quantize_int4
op = int4_matmul_op()
def t(f, reps=300):
    for _ in range(10): f()
    ts=[]
    for _ in range(reps):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]*1e6
# many copies so weights stream from memory, as in a decode step
for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536), (8, 576)):
    copies = max(1, int(60e6 // (n * k // 2 + n * k // 32 * 8)))
    layers = []
    for _ in range(copies):
        q, s, m = quantize_int4(torch.randn(n, k), 32)
        layers.append(((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), s, m))
    x = torch.randn(1, k)
    i = [0]
    def call():
        p, s, m = layers[i[0] % copies]; i[0] += 1
        op(x, p, s, m, 32)
    us = t(call)
    mb = (n * k // 2 + n * k // 32 * 8) / 1e6
    print(f"{n}x{k}: {us:.1f} us, {mb:.3f} MB, {mb / us * 1e3:.1f} GB/s")
