"""Load the same checkpoint in transformers, as the reference side of benchmarks and tests."""

from __future__ import annotations

import os

import torch


def load_hf_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """A transformers causal LM from a model directory or a .gguf file (dequantized)."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()
