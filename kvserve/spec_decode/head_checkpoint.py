"""Reading a draft head's checkpoint directory (Medusa, EAGLE, EAGLE-3): its config.json and
the first weight file of the layouts it may come in."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def read_head_checkpoint(path: str, kind: str, weight_files: tuple[str, ...], described: str,
                         strip_prefix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state dict) of the head at `path`; `kind` names it in errors ("a Medusa"),
    `described` says what a directory of that kind holds; `strip_prefix` comes off the keys."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"speculative_config: model={path!r} has no config.json; allowed: {described}")
    with open(config_path) as f:
        config = json.load(f)
    for name in weight_files:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            state = load_file(file) if name.endswith(".safetensors") else torch.load(
                file, map_location="cpu", weights_only=True)
            return config, {key.removeprefix(strip_prefix): tensor for key, tensor in state.items()}
    raise ValueError(f"speculative_config: model={path!r} is not {kind} checkpoint; allowed: a directory "
                     f"with config.json and one of {list(weight_files)}")
