"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's kernels.

At batch 1 a decode step is a chain of ~350 short kernels, and each starts with dead time:
its launch, its prologue and the DRAM latency of its first loads, which on the small
projections is a large part of the ~10 us they take (BENCHMARKS.md, "Kernel level (GPU)":
one kernel a linear reads the small linears at 1.7-2.2 TB/s of the 3.0 a copy reaches).
Launched with PDL, a kernel's programs start while the kernel before it still runs, and
wait (`gdc_wait`) before reading that kernel's output. The one-row GEMVs load their first
weight tiles (which nothing in the step writes) before they wait, and attention at narrow
decode batches its sequences' metadata. The elementwise kernels (RMSNorm, RoPE, the
KV-cache write, SiLU-and-mul) wait first thing (`chained`). Every kernel of the chain lets
its own dependents launch from its first instruction (`gdc_launch_dependents`): a
dependent only launches once every program of the kernel before it has started, and waits
for it to finish, which it can only do after the kernel before it finished, so a chain
never reads early and never holds SM slots its predecessors need. The fp8 mma.sync GEMV is
a dependent like the one-row ones (first tile, then the wait); the int4 mma.sync GEMV
(0.2 ms a step slower as one: BENCHMARKS.md, "Tried, did not pay"), the tl.dot tiles and
the byte kernel are not launched as dependents, and the int4 mma.sync and byte kernels let
the next kernel launch early. (The tl.dot word kernels stay off PDL: launched under it, an
H100 run of the int4 latency benchmark hung.)

`KVSERVE_PDL=0` turns it off (for side-by-side timing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve import envs
from kvserve.ops import device as device_info


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use PDL: CUDA on sm_90 or newer, not the interpreter,
    not turned off by KVSERVE_PDL=0."""
    if device.type != "cuda" or envs.TRITON_INTERPRET:
        return False
    return envs.KVSERVE_PDL and device_info.hopper_or_newer(device.index or 0)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel that waits (`gdc_wait`) before reading its inputs."""
    return {"launch_pdl": True} if enabled(device) else {}


def chained_options(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel that starts with `chained(PDL)`: its PDL flag and, where
    PDL is on, the dependent launch."""
    return {"PDL": enabled(device), **launch_options(device)}


@triton.jit
def chained(PDL: tl.constexpr):
    """First thing in a kernel launched with `chained_options`: let the next kernel launch,
    then wait until the kernel before this one has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
