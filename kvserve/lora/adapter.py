"""A PEFT LoRA adapter read from disk (adapter_config.json + adapter_model.safetensors or
.bin) and checked against the model it is to run on: each targeted projection's A [r, in]
and B [out, r], B already multiplied by the adapter's scaling (lora_alpha / r, or / sqrt(r)
with use_rslora; per module where rank_pattern / alpha_pattern say so), grouped by the
kvserve linear the projection is a slice of."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from kvserve.config import ModelConfig
from kvserve.lora.request import LoRARequest
from kvserve.lora.targets import TARGET_PROJECTIONS, hf_targets

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."
_WEIGHT_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<kind>A|B)\.weight")


class LoRAError(ValueError):
    """An adapter that cannot run on this model, with what is wrong and the limit it breaks."""


@dataclass
class SliceWeights:
    slice_index: int
    lora_a: torch.Tensor  # [r, in_features]
    lora_b: torch.Tensor  # [slice out_features, r], times the scaling


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int  # the largest rank of its modules
    # kvserve linear name -> the slices the adapter changes (others stay base-only).
    linears: dict[str, list[SliceWeights]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
                   for slices in self.linears.values() for w in slices)


def load_adapter(request: LoRARequest, config: ModelConfig, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check the adapter; raises LoRAError naming the adapter, the value and the limit."""
    name = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    peft_config = _read_config(request.lora_path, name)
    tensors = _read_weights(request.lora_path, name)
    targets = hf_targets(config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module_key = key.removeprefix(_PEFT_PREFIX)
        match = _WEIGHT_KEY.fullmatch(module_key)
        if match is None:
            raise LoRAError(f"{name}: weight {key!r} is not a LoRA A/B matrix of a linear (kvserve's LoRA "
                            f"takes adapters of {', '.join(TARGET_PROJECTIONS)} only: no embeddings, "
                            "biases, DoRA magnitudes or modules_to_save)")
        module = match["module"]
        if module not in targets:
            raise LoRAError(f"{name}: target module {module!r} is not a linear this model "
                            f"({config.architecture}, {config.num_hidden_layers} layers) has an adapter slot "
                            f"for; adapters may target {', '.join(TARGET_PROJECTIONS)} (was it trained for "
                            f"another base model? base_model_name_or_path="
                            f"{peft_config.get('base_model_name_or_path')!r})")
        pairs.setdefault(module, {})[match["kind"]] = tensor
    if not pairs:
        raise LoRAError(f"{name}: the weight file holds no LoRA matrices")
    _check_supported(peft_config, name)
    adapter = LoRAAdapter(request, rank=0)
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"{name}: {module} has no {missing}.weight")
        target = targets[module]
        lora_a, lora_b = pair["A"], pair["B"]
        rank = lora_a.shape[0]
        expected_a, expected_b = (rank, target.linear.in_features), (target.out_features, rank)
        if tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
            raise LoRAError(f"{name}: {module} has lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)}; "
                            f"this model ({config.architecture}, hidden size {config.hidden_size}) needs "
                            f"{expected_a} and {expected_b} (was it trained for another base model? "
                            f"base_model_name_or_path={peft_config.get('base_model_name_or_path')!r})")
        if rank > max_lora_rank:
            raise LoRAError(f"{name}: rank {rank} of {module} is above --max-lora-rank {max_lora_rank}; "
                            f"start the server with --max-lora-rank {rank} or more")
        scaling = _scaling(peft_config, module, rank)
        adapter.rank = max(adapter.rank, rank)
        adapter.linears.setdefault(target.linear.module_name, []).append(SliceWeights(
            target.slice_index, lora_a.to(dtype).contiguous(), (lora_b.double() * scaling).to(dtype).contiguous()))
    return adapter


def _read_config(path: str, name: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        what = "does not exist" if not os.path.exists(path) else f"has no {CONFIG_FILE}"
        raise LoRAError(f"{name}: the path {what}; a LoRA adapter is a directory saved by PEFT "
                        f"({CONFIG_FILE} + {' or '.join(WEIGHT_FILES)})")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except ValueError as error:
        raise LoRAError(f"{name}: {CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{name}: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{name}: peft_type is {peft_type!r}; kvserve serves LORA adapters")
    return config


def _check_supported(config: dict, name: str) -> None:
    """What the matrices alone do not show: options that change how they apply."""
    unsupported = {
        "bias": (config.get("bias", "none"), "none"),
        "use_dora": (bool(config.get("use_dora")), False),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), False),
        "modules_to_save": (config.get("modules_to_save") or None, None),
        "lora_bias": (bool(config.get("lora_bias")), False),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise LoRAError(f"{name}: {key}={value!r} is not supported (kvserve's LoRA needs {key}={supported!r})")


def _read_weights(path: str, name: str) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        weight_path = os.path.join(path, file_name)
        if not os.path.isfile(weight_path):
            continue
        try:
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(weight_path)
            return torch.load(weight_path, map_location="cpu", weights_only=True)
        except Exception as error:  # a truncated or foreign file: say which
            raise LoRAError(f"{name}: cannot read {file_name}: {error}") from None
    raise LoRAError(f"{name}: no {' or '.join(WEIGHT_FILES)} next to {CONFIG_FILE}")


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module name's end."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _scaling(config: dict, module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
