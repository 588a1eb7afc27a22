"""kvserve's own CPU kernels (C++ in csrc/), built on first use for the CPU at hand.

`int8_matmul`: y = x @ (q * scale)^T with fp32 activations, for the few rows of a decode
step (csrc/int8_matmul.cpp says how). torch's `_weight_int8pack_mm` wants bf16 activations
(a cast in and one out per call) and streams the weight at well under the memory bandwidth;
BENCHMARKS.md ("CPU: an int8 kernel of our own") has the measurements that made this worth
its build.

The build (torch's cpp_extension, ~30 s once, cached under ~/.cache/torch_extensions) uses
-march=native, so the cache key includes the CPU's flags: a cache shared between machines
never hands one CPU another's instructions. Where there is no compiler, `int8_matmul_op()`
returns None and callers keep torch's kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "int8_matmul.cpp"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def int8_matmul_op() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """torch.ops.kvserve_cpu.int8_matmul, built if needed; None where it cannot be built."""
    from torch.utils import cpp_extension

    key = hashlib.sha1(f"{_cpu_flags()} {torch.__version__}".encode()).hexdigest()[:12]
    logger.info("loading the int8 CPU kernel (built once per CPU and torch version: ~30 s "
                "the first time)")
    try:
        cpp_extension.load_inline(
            name=f"kvserve_int8_matmul_{key}", cpp_sources=[_SOURCE.read_text()],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as error:  # no compiler or ninja
        logger.warning("int8 CPU kernel not built (%s); using torch's int8 kernel", error)
        return None
    # Shapes for torch.compile: the compiled CPU decode graph calls the op like any kernel.
    torch.library.register_fake("kvserve_cpu::int8_matmul", _int8_matmul_shape)
    return torch.ops.kvserve_cpu.int8_matmul


def _int8_matmul_shape(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])
