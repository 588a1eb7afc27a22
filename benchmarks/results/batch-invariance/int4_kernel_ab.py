import time, torch, sys
from torch.utils import cpp_extension
from kvserve.ops.cpu import int4_matmul_op
new = int4_matmul_op()
cpp_extension.load(name="kvserve_old_int4", sources=["/tmp/oldk/decode_matmul_old.cpp"], build_directory="/tmp/oldk",
                   extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False)
old = torch.ops.kvserve_cpu_old.int4_matmul
torch.manual_seed(0)
# SmolLM2 layer: q, k, v, o, gate, up, down
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
layers = []
for n, k in shapes:
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s = (torch.rand(n, k // 32) * 0.01).half(); mn = (-torch.rand(n, k // 32) * 0.05).half()
    layers.append((q, s, mn))
import copy
layers = [tuple(t.clone() for t in l) for l in layers for _ in range(30)]
x = torch.randn(64, 1536)
# invariance: rows of the new kernel at any row count equal its one-row result
for q, s, mn in layers[-3:]:
    k = q.shape[1] * 2
    solo = torch.cat([new(x[i:i+1, :k], q, s, mn, 32) for i in range(33)])
    for m in (2, 3, 5, 8, 16, 17, 32, 33):
        assert torch.equal(new(x[:m, :k], q, s, mn, 32), solo[:m]), m
    print("new invariant", q.shape, "| old 1 vs 2 rows equal:", torch.equal(old(x[:2, :k], q, s, mn, 32)[0], old(x[:1, :k], q, s, mn, 32)[0]),
          "| new 1-row == old 1-row:", torch.equal(solo[:1], old(x[:1, :k], q, s, mn, 32)))
def step(op, m):
    for q, s, mn in layers:  # 30 layers' worth, streamed from memory
        op(x[:m, :q.shape[1] * 2], q, s, mn, 32)
res = {}
for rep in range(15):
    for m in (1, 2, 4, 8, 16, 32):
        for name, op in (("old", old), ("new", new)):
            step(op, m)
            t = time.perf_counter(); step(op, m); dt = time.perf_counter() - t
            res.setdefault((m, name), []).append(dt * 1e3)
for m in (1, 2, 4, 8, 16, 32):
    import statistics as st
    print(f"{m:3d} rows: old {st.median(res[(m,'old')]):6.2f} / {min(res[(m,'old')]):6.2f} ms  new {st.median(res[(m,'new')]):6.2f} / {min(res[(m,'new')]):6.2f} ms (median / min of 15, 210 linears)")
