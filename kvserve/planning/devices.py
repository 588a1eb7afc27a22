"""The devices `kvserve plan` knows: memory, bandwidth and matmul peak of each."""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str  # "cuda" or "cpu": which of the engine's memory budgets applies
    memory_bytes: int  # what torch reports as the device's total
    bandwidth: float  # bytes/s
    peak_flops: float  # dense bf16 tensor-core FLOP/s on GPUs, fp32 on a CPU
    source: str  # where the ceilings come from


def _mib(n: int) -> int:
    return n * 2**20


_NOMINAL = "nominal (spec sheet) bandwidth and dense bf16 peak"
# Totals as nvidia-smi and torch report them; SXM parts where there are several.
KNOWN_GPUS: dict[str, DeviceSpec] = {
    spec.name: spec for spec in (
        DeviceSpec("h100-80gb", "cuda", _mib(81559), 3.35e12, 989e12, _NOMINAL),
        DeviceSpec("h200", "cuda", _mib(143771), 4.8e12, 989e12, _NOMINAL),
        DeviceSpec("a100-80gb", "cuda", _mib(81920), 2.039e12, 312e12, _NOMINAL),
        DeviceSpec("l40s", "cuda", _mib(46068), 0.864e12, 362e12, _NOMINAL),
        DeviceSpec("l4", "cuda", _mib(23034), 0.3e12, 121e12, _NOMINAL),
    )
}
# Substrings of torch.cuda.get_device_name() for `auto`, most specific first.
_GPU_NAMES = (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"), ("L40S", "l40s"), ("L4", "l4"))


def known_devices() -> str:
    return ", ".join([*KNOWN_GPUS, "cpu:GiB", "auto"])


def _measured_cpu(memory_bytes: int) -> DeviceSpec:
    """A CPU with this machine's copy bandwidth and fp32 matmul rate, measured now (<1 s)."""
    import torch

    from kvserve.benchmarks.roofline import copy_bandwidth, matmul_peak_flops

    cpu = torch.device("cpu")
    return DeviceSpec(f"cpu:{memory_bytes / GiB:.1f}", "cpu", memory_bytes, copy_bandwidth(cpu, repeats=5),
                      matmul_peak_flops(cpu, repeats=3), "bandwidth and fp32 matmul measured on this machine")


def _this_machine() -> DeviceSpec:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        _, total = torch.cuda.mem_get_info()
        for fragment, known in _GPU_NAMES:
            if fragment in name:
                return DeviceSpec(known, "cuda", total, KNOWN_GPUS[known].bandwidth,
                                  KNOWN_GPUS[known].peak_flops, f"{name}; {_NOMINAL}")
        raise ValueError(f"this machine's GPU ({name}) is not among the known devices; "
                         f"name the closest with --device ({known_devices()})")
    return _measured_cpu(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve_device(name: str) -> DeviceSpec:
    """A known GPU, `cpu:GiB` (a CPU with that much memory, ceilings measured here), or
    `auto` (this machine)."""
    if name == "auto":
        return _this_machine()
    if name in KNOWN_GPUS:
        return KNOWN_GPUS[name]
    if name.startswith("cpu:"):
        try:
            gib = float(name.removeprefix("cpu:"))
        except ValueError:
            gib = 0.0
        if gib > 0:
            return _measured_cpu(int(gib * GiB))
    raise ValueError(f"unknown device {name!r}; known: {known_devices()}")
