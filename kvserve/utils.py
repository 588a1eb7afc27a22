"""Small helpers shared across the package."""

from __future__ import annotations

import math
import re

import numpy as np
import torch

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3,
}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648; plain numbers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512MiB, 2GiB or 1000000")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def to_device_async(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on `device` without waiting for it: a plain copy to a GPU waits for all
    work queued before it (undoing overlapped scheduling); one from pinned memory does not."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)



def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros on the host whose pages the OS maps on first write (numpy's calloc): a CPU KV
    cache then costs resident memory only for the blocks in use, not its whole budget up front."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
