"""Tile configurations for the fused mixture-of-experts GEMMs, per device and shape.

`python -m kvserve.benchmarks.tune_fused_moe` times candidate tiles on the device and writes
`configs/fused_moe/<device name>.json`: for each shape key (experts, hidden, intermediate,
weight format) and token count, the BLOCK_M the (token, choice) pairs are aligned to and one tile for
each of the two GEMMs. A launch takes the entry of the nearest tuned token count; shapes or
devices never tuned get the default below, which is sound everywhere but tuned nowhere.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs" / "fused_moe"


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gate_up: GemmTile
    down: GemmTile

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, entry: dict) -> MoEConfig:
        return cls(entry["block_m"], GemmTile(**entry["gate_up"]), GemmTile(**entry["down"]))


def shape_key(experts: int, hidden: int, intermediate: int, weight_format: str) -> str:
    """weight_format: fused_moe.weight_format's name (bfloat16, int4-g128, ...)."""
    return f"E={experts},H={hidden},I={intermediate},dtype={weight_format}"


def device_file(device_name: str) -> Path:
    return CONFIG_DIR / (device_name.replace(" ", "_") + ".json")


@functools.cache
def _tuned(device_name: str) -> dict[str, dict[int, MoEConfig]]:
    path = device_file(device_name)
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {key: {int(tokens): MoEConfig.from_json(entry) for tokens, entry in by_tokens.items()}
            for key, by_tokens in raw.items()}


def default_config(tokens: int) -> MoEConfig:
    """Decode-sized batches route a few rows to each expert: 16-row tiles (tl.dot's minimum)
    waste the least on padding; prefill-sized ones fill 64-row tiles."""
    if tokens <= 64:
        return MoEConfig(16, GemmTile(64, 128, 4, 4), GemmTile(32, 128, 4, 4))
    return MoEConfig(64, GemmTile(128, 64, 4, 3), GemmTile(128, 64, 4, 3))


def config_for(tokens: int, experts: int, hidden: int, intermediate: int, weight_format: str,
               device: torch.device) -> MoEConfig:
    """The tuned entry of the nearest token count for this device and shape, else the default."""
    if device.type != "cuda":  # Triton's interpreter
        return default_config(tokens)
    return tuned_config(torch.cuda.get_device_name(device), tokens, experts, hidden, intermediate, weight_format)


def tuned_config(device_name: str, tokens: int, experts: int, hidden: int, intermediate: int,
                 weight_format: str) -> MoEConfig:
    tuned = _tuned(device_name).get(shape_key(experts, hidden, intermediate, weight_format))
    if not tuned:
        return default_config(tokens)
    return tuned[min(tuned, key=lambda tuned_tokens: abs(tuned_tokens - tokens))]
