"""Which of the model's linears an adapter may target, and where each Hugging Face projection
sits in kvserve's fused ones (q/k/v in qkv_proj, gate/up in gate_up_proj, stacked by output
rows): computed from the model's config alone, so the front can check an adapter without
the weights."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig

# Hugging Face projection names an adapter may target.
TARGET_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LinearSlices:
    """One of kvserve's linears: its output rows split into the projections stacked in it."""

    module_name: str  # e.g. model.layers.3.self_attn.qkv_proj
    in_features: int
    slice_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.slice_sizes)


@dataclass(frozen=True)
class TargetSlice:
    """A Hugging Face projection: the kvserve linear holding it, and which slice it is."""

    linear: LinearSlices
    slice_index: int

    @property
    def out_features(self) -> int:
        return self.linear.slice_sizes[self.slice_index]


def lora_linears(config: ModelConfig) -> list[LinearSlices]:
    """Every linear of the decoder that adapters may target: attention everywhere, the MLP in
    dense layers (a mixture's experts take no adapter)."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    linears = []
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}"
        linears += [
            LinearSlices(f"{prefix}.self_attn.qkv_proj", hidden, (q_size, kv_size, kv_size)),
            LinearSlices(f"{prefix}.self_attn.o_proj", q_size, (hidden,)),
        ]
        if not config.num_experts or index in config.dense_mlp_layers:
            linears += [
                LinearSlices(f"{prefix}.mlp.gate_up_proj", hidden, (intermediate, intermediate)),
                LinearSlices(f"{prefix}.mlp.down_proj", intermediate, (hidden,)),
            ]
    return linears


_HF_LEAVES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_targets(config: ModelConfig) -> dict[str, TargetSlice]:
    """Hugging Face module name (model.layers.0.self_attn.q_proj) -> its slice of ours."""
    targets = {}
    for linear in lora_linears(config):
        prefix, _, leaf = linear.module_name.rpartition(".")
        for index, hf_leaf in enumerate(_HF_LEAVES.get(leaf, (leaf,))):
            targets[f"{prefix}.{hf_leaf}"] = TargetSlice(linear, index)
    return targets
