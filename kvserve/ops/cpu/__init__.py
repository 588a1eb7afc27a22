"""kvserve's own CPU kernels (C++ in csrc/), built on first use for the CPU at hand, for the
few rows of a decode step:

* `int8_matmul`: y = x @ (q * scale + offset)^T with fp32 activations, one scale an output
  channel or one a group of columns (a multiple of 16: GGUF's Q8_0 and Q6_K grids), and
  optionally an offset per group (Q5_K, and Q4_K stacked with Q6_K in one layer). torch's `_weight_int8pack_mm`
  wants bf16 activations (a cast in and one out per call) and streams the weight at well
  under the memory bandwidth (about a quarter of it at one row on a 2-core EPYC); this one
  quantizes each activation row to int16 and runs int16 multiply-adds, which keep up with
  reading the weight at the bandwidth.
* `int4_matmul`: the same for 4-bit nibble pairs with group scales and minimums (float zero
  points), read in the GPU kernel's row-major layout; torch's `_weight_int4pack_mm_for_cpu`
  wants bf16 activations and its own layout, and took twice the time at one row.
* `float_matmul`: y = x @ w^T in fp32, for the model's dense linears and the LM head at
  decode rows: MKL's sgemv reads them at well under the bandwidth (~8 of the 18.5 GB/s a
  plain read reaches on a 2-core EPYC), this kernel reads each weight tile once for every row.
* `decode_attention`: single-token decodes attending to a paged fp32 KV cache in place,
  instead of gathering each layer's context into a padded copy for SDPA.
* `lora_add_`: the multi-LoRA deltas of a step added in place to a linear's output, each
  token through its own adapter slot's matrices only (kvserve/lora/layers.py).

The build (torch's cpp_extension, ~50 s once, cached under ~/.cache/torch_extensions) uses
-march=native (KVSERVE_CPU_ARCH_FLAGS), so the cache key includes the CPU's flags: a cache
shared between machines never hands one CPU another's instructions. Where there is no
compiler, the ops are None and callers keep torch's kernels. Processes build one at a time
(_exclusive_build), and a build interrupted by a kill does not hang the next start.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvserve import envs

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_directory() -> Path:
    """Where the kernels for this CPU, torch, Python and source directory are built: one
    directory per key under TORCH_EXTENSIONS_DIR or torch's default root. Two checkouts
    sharing the cache do not rebuild each other's build (its commands name the source
    paths) or rewrite a library the other has loaded."""
    from torch.utils import cpp_extension

    identity = f"{cpu_flags()} {torch.__version__} {sys.version_info[:2]} {Path(__file__).parent}"
    if envs.KVSERVE_CPU_ARCH_FLAGS != ["-march=native"]:
        identity += f" {envs.KVSERVE_CPU_ARCH_FLAGS}"
    key = hashlib.sha1(identity.encode()).hexdigest()[:12]
    root = envs.TORCH_EXTENSIONS_DIR or cpp_extension.get_default_build_root()
    return Path(root) / f"kvserve_cpu_kernels_{key}"


@contextlib.contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Holds an flock on `directory` while the kernels build or load. torch's own lock is a
    file that waiters poll until it is gone, so a process killed mid-build (Ctrl-C during
    the first start) leaves it behind and every later start waits forever. The OS releases
    an flock when its holder dies, so a torch lock file seen while holding the flock is such
    a leftover, and goes."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvserve.flock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building kvserve's CPU kernels")
            fcntl.flock(handle, fcntl.LOCK_EX)
        leftover = directory / "lock"
        if leftover.exists():
            logger.warning("removing %s, left by an interrupted build of kvserve's CPU kernels", leftover)
            leftover.unlink()
        yield


@functools.cache
def _built() -> bool:
    """Builds (or loads the cached build of) the kernels; False where that is impossible."""
    from torch.utils import cpp_extension

    directory = build_directory()
    logger.info("loading kvserve's CPU kernels (built once per CPU and install: ~50 s "
                "the first time)")
    try:
        with _exclusive_build(directory):
            cpp_extension.load(
                name=directory.name, sources=[str(path) for path in _SOURCES], build_directory=str(directory),
                extra_cflags=["-O3", *envs.KVSERVE_CPU_ARCH_FLAGS, "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except (OSError, RuntimeError, ImportError) as error:  # no compiler or ninja; no flock
        logger.warning("kvserve's CPU kernels not built (%s); using torch's kernels", error)
        return False
    # Shapes for torch.compile: the compiled CPU decode graph calls the ops like any kernel.
    torch.library.register_fake("kvserve_cpu::int8_matmul", _matmul_shape)
    torch.library.register_fake("kvserve_cpu::float_matmul", _float_matmul_shape)
    torch.library.register_fake("kvserve_cpu::int4_matmul", _int4_matmul_shape)
    torch.library.register_fake("kvserve_cpu::decode_attention", _decode_attention_shape)
    torch.library.register_fake("kvserve_cpu::lora_add_", _lora_add_shape)
    return True


def available() -> bool:
    """Whether the kernels are built (building them if needed). torch.compile calls it rather
    than tracing it (file reads Dynamo cannot trace), so compiled graphs call the ops like
    eager steps do: CompiledDecode marks it so (assume_constant_result) before it compiles,
    as a decorator here would import Dynamo into every process that loads kvserve (~1.2 s)."""
    return _built()


def int8_matmul_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.kvserve_cpu.int8_matmul, built if needed; None where it cannot be built."""
    return torch.ops.kvserve_cpu.int8_matmul if _built() else None


def int4_matmul_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.kvserve_cpu.int4_matmul, built if needed; None where it cannot be built."""
    return torch.ops.kvserve_cpu.int4_matmul if _built() else None


def float_matmul_op() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """torch.ops.kvserve_cpu.float_matmul, built if needed; None where it cannot be built."""
    return torch.ops.kvserve_cpu.float_matmul if _built() else None


def decode_attention_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.kvserve_cpu.decode_attention, built if needed; None where it cannot be built."""
    return torch.ops.kvserve_cpu.decode_attention if _built() else None


def lora_add_op() -> Callable[..., None] | None:
    """torch.ops.kvserve_cpu.lora_add_, built if needed; None where it cannot be built."""
    return torch.ops.kvserve_cpu.lora_add_ if _built() else None


def _matmul_shape(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def _int4_matmul_shape(x: torch.Tensor, q: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def _float_matmul_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _decode_attention_shape(query: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _lora_add_shape(*args: object) -> None:
    return None
