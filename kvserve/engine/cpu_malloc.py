"""Keep freed CPU activation memory in the process instead of handing it back per step.

glibc serves allocations above its mmap threshold (128 KB, raised adaptively up to 32 MB)
with fresh mappings and unmaps them on free, and trims the heap top above 128 KB: every
step's larger activations (a 512-token chunk's MLP output is 3 MB, a 16-sequence decode's
gathered context about as much) are page-faulted in again, 4 KB at a time. Measured on the
2-core development VM: 460,000 minor faults per 2,048 prefilled SmolLM2 tokens, 1.43 s;
with the settings below ~0 faults and 1.02-1.10 s. The cost is that the largest transient
working set stays resident once reached.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc's largest allowed threshold on 64-bit; larger blocks (a KV cache layer, weights)
# still get mappings of their own.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def retain_freed_memory() -> bool:
    """Set glibc's thresholds so freed blocks are reused, not unmapped; False where the C
    library is not glibc (the defaults then stay)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    if not all(mallopt(param, value) == 1 for param, value in settings):
        return False
    logger.info("CPU allocator: freed blocks under %d MiB are kept for reuse (no page faults per step)",
                MMAP_THRESHOLD >> 20)
    return True
