"""The CPU engine's allocator settings: freed activation blocks are reused, not re-faulted."""

from __future__ import annotations

import ctypes
import resource

import pytest
import torch

from kvserve.engine.cpu_malloc import retain_freed_memory

_FAULT_FREE_ROUNDS = 8
_MAX_ROUNDS = 64


def _minor_faults_of_one_round(num_bytes: int) -> int:
    """Page faults of allocating, touching and freeing one block and one of half its size.

    Counted for this thread only and touched by this thread only (memset, not a
    multi-threaded fill), so another thread of the test process faulting its own memory
    meanwhile is not counted.
    """
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    blocks = [torch.empty(num_bytes, dtype=torch.uint8), torch.empty(num_bytes // 2, dtype=torch.uint8)]
    for block in blocks:
        ctypes.memset(block.data_ptr(), 1, block.numel())  # touch every page
    del blocks, block
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_freed_blocks_are_reused_without_page_faults():
    if not retain_freed_memory():
        pytest.skip("not glibc: the allocator keeps its defaults")
    # 16 + 8 MB, a 512-token MLP activation's order (6,144 pages a round). Retained, the heap
    # settles after a warm-up of 1 to ~10 rounds: glibc's bins place the next blocks above
    # small chunks left between the freed ones, so the heap grows a few times (e.g. 6148,
    # 4096, 4096, 2048, 0, ...). From then on every round reuses resident pages; a heap that
    # hands freed blocks back (trims or unmaps them) faults 2,000-6,000 pages every round and
    # never reaches the fault-free streak.
    faults: list[int] = []
    while len(faults) < _MAX_ROUNDS:
        faults.append(_minor_faults_of_one_round(16 << 20))
        streak = faults[-_FAULT_FREE_ROUNDS:]
        if len(streak) == _FAULT_FREE_ROUNDS and max(streak) < 100:
            break
    steady = faults[-_FAULT_FREE_ROUNDS:]
    assert len(faults) >= _FAULT_FREE_ROUNDS and max(steady) < 100, faults
