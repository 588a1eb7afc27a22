"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's weight kernels.

At batch 1 a decode step is a chain of ~200 short kernels, and each weight-streaming GEMV
starts with dead time: its launch, its prologue and the DRAM latency of its first tiles,
which on the small projections is a large part of the ~10 us they take (BENCHMARKS.md, "int4
decode kernel — what bounds it"). Launched with PDL, a GEMV's programs start while the kernel
before it still runs: they load their first weight tiles (which nothing in the step writes)
and only then wait (`gdc_wait`) for the previous kernel's output. The kernels that precede
GEMVs (RMSNorm, SiLU-and-mul, attention) let their dependents launch from their first
instruction (`gdc_launch_dependents`); that is all it does, so it is safe before any kernel.
Only the one-row ("fma") word kernels wait this way: with the tensor-core word kernels (2-64
rows) launched under PDL as well, an H100 run of the int4 latency benchmark never finished.

`KVSERVE_PDL=0` turns it off (for side-by-side timing).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use PDL: CUDA on sm_90 or newer, not the interpreter,
    not turned off by KVSERVE_PDL=0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return os.environ.get("KVSERVE_PDL", "1") != "0" and _capable(device.index or 0)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel that waits (`gdc_wait`) before reading its inputs."""
    return {"launch_pdl": True} if enabled(device) else {}
