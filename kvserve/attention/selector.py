"""Pick the attention backend for a device."""

from __future__ import annotations

import torch

from kvserve import envs
from kvserve.attention.backend import AttentionBackend
from kvserve.attention.torch_ref import TorchReferenceBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def get_attn_backend(
    device: torch.device, name: str = "auto", sliding_window: int | None = None
) -> AttentionBackend:
    """"auto": Triton on CUDA, the torch reference elsewhere (and for sliding-window models,
    which the Triton kernels do not implement yet); "torch" or "triton" explicitly.
    Triton on a CPU device only runs under its interpreter (TRITON_INTERPRET=1)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"Unknown attention backend {name!r}; choose one of {BACKEND_NAMES}.")
    if name == "auto":
        name = "triton" if device.type == "cuda" and sliding_window is None else "torch"
    if name == "torch":
        return TorchReferenceBackend(sliding_window)
    if sliding_window is not None:
        raise ValueError(
            f"The triton attention backend has no sliding-window attention (this model uses a "
            f"window of {sliding_window}); use the 'torch' backend."
        )
    if device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError(
            f"The triton attention backend needs a CUDA device, got {device.type!r}; "
            "use the 'torch' backend."
        )
    # Imported here so that CPU-only installs never need Triton.
    from kvserve.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
