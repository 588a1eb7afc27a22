"""Random LoRA adapters in PEFT's format and a model's real shapes, for benchmarks: what an
adapter costs does not depend on what it learned."""

from __future__ import annotations

import json
import os

import torch

from kvserve.config import ModelConfig
from kvserve.lora.adapter import CONFIG_FILE
from kvserve.lora.targets import TARGET_PROJECTIONS, hf_targets


def write_random_adapter(directory: str, config: ModelConfig, rank: int, seed: int) -> str:
    """A rank-`rank` adapter on all seven projections of every layer, saved under `directory`;
    A ~ N(0, 1/in) and B ~ N(0, 0.01^2), so its deltas stay small next to the base's output."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for hf_name, target in hf_targets(config).items():
        in_features = target.linear.in_features
        prefix = f"base_model.model.{hf_name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(target.out_features, rank, generator=generator) * 0.01
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_PROJECTIONS),
                   "bias": "none", "use_rslora": False}, f)
    return directory
