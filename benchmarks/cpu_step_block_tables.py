"""Host time of a 256-sequence step's block tables on the CPU: the KV manager's ids as lists
and as its int32 arrays, packed into one tensor (what CudaGraphRunner.run and the model
runner copy to the device every step). Contexts of 100-2,000 tokens, 16-token blocks.

    PYTHONPATH=. python benchmarks/cpu_step_block_tables.py
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.model_executor.block_tables import pack_block_tables


def ms_per_call(call: Callable[[], object], repeats: int = 300) -> float:
    for _ in range(10):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    random.seed(0)
    manager = KVCacheManager(num_blocks=40000, block_size=16, enable_prefix_caching=False)
    seq_ids = [f"s{i}" for i in range(256)]
    for seq_id in seq_ids:
        tokens = random.randint(100, 2000)
        manager.allocate_slots(seq_id, [0] * tokens, 0, tokens)
    as_lists = lambda: pack_block_tables([manager.block_ids(s) for s in seq_ids])  # noqa: E731
    as_arrays = lambda: pack_block_tables([manager.block_id_array(s) for s in seq_ids])  # noqa: E731
    assert as_lists().equal(as_arrays())
    print(f"ids as lists, then packed: {ms_per_call(as_lists):.3f} ms; "
          f"as the manager's int32 arrays: {ms_per_call(as_arrays):.3f} ms")


if __name__ == "__main__":
    main()
