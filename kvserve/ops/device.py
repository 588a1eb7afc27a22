"""What the launch configurations ask of the device they run on."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device, off_gpu: int = 1) -> int:
    """Streaming multiprocessors of CUDA `device`; `off_gpu` elsewhere (the interpreter)."""
    if device.type != "cuda":
        return off_gpu
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def hopper_or_newer(device_index: int) -> bool:
    """Whether CUDA device `device_index` is sm_90 or newer (programmatic dependent launch
    needs it)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9
