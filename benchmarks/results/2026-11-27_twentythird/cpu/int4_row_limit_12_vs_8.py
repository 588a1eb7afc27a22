import statistics, sys, time
sys.path.insert(0, "benchmarks")
from cpu_int4_kernel import load
from kvserve.benchmarks.cpu_decode import DecodeStepTimer, run_round
engines = {}
for rows in (8, 12):
    llm = load("auto", True, rows); engines[rows] = (llm, DecodeStepTimer(llm))
ms = {}
for r in range(5):
    order = [8, 12] if r % 2 == 0 else [12, 8]
    for batch in (10, 12):
        for rows in order:
            llm, timer = engines[rows]
            ms.setdefault((rows, batch), []).append(run_round(llm, timer, batch, 64, 64, seed=r)[0])
    print(r, {k: round(v[-1], 2) for k, v in ms.items()}, flush=True)
for batch in (10, 12):
    a, b = statistics.median(ms[8, batch]), statistics.median(ms[12, batch])
    print(f"batch {batch}: int4 kernel up to 8 rows (fp32 beyond) {a:.2f} ms a step, up to 12 rows {b:.2f} ms ({a / b:.2f}x)")
