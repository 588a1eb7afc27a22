import time, random
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.block_map import build_block_map
for num_blocks in (364, 10_000, 100_000):
    kv = KVCacheManager(num_blocks, 16)
    # 256 sequences holding ~60% of the cache, some blocks cached
    per = int(num_blocks * 0.6 / 256)
    for i in range(256):
        kv.allocate_slots(f"r{i}#0", list(range(per*16)), 0, per*16)
    ts=[]
    for _ in range(20):
        t=time.perf_counter(); m=build_block_map(kv, lambda s: s.rpartition("#")[0]); ts.append(time.perf_counter()-t)
    ts.sort()
    print(num_blocks, f"median {ts[10]*1e3:.2f} ms  min {ts[0]*1e3:.2f} ms  runs {len(m.runs)//2}")
