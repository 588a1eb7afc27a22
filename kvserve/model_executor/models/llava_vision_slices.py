"""LLaVA's CLIP / SigLIP vision tower run a slice at a time (the Qwen2-VL counterpart, with
the design notes, is qwen_vision_slices.py).

The patch embeddings (a convolution, a class token for CLIP, positions, CLIP's pre-layernorm)
are computed for the whole batch when it begins: a small fraction of one layer's work. Then
pass 0 projects layer 0's q/k/v, and pass p (1..k) runs layer p-1 on the rows and projects the
next layer's q/k/v; k is the deepest hidden state the model takes its features from (layers
past it never run). The last pass also runs the projector on its rows, from the feature
layers' rows kept as their passes went by."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.model_executor.models.vision_slices import advance_rows, segment_attention


@dataclass
class ClipSliceState:
    """One batch of images part way through the tower."""

    segment_starts: list[int]  # each image's first row, then the row count
    rows_per_image: int
    skip: int  # leading rows of each image the features leave out (CLIP's class token)
    feature_layers: list[int]  # hidden-state indices the features concatenate, in order
    hidden: torch.Tensor  # [rows, dim]: hidden state `pass_index` (filled as rows go)
    next_hidden: torch.Tensor
    qkv: torch.Tensor  # [3, rows, heads, head dim] of the layer this pass runs
    next_qkv: torch.Tensor
    merged: torch.Tensor  # [rows, out dim]: the projector's output
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # earlier feature layers' rows
    pass_index: int = 0
    row: int = 0

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def num_passes(self) -> int:
        return max(self.feature_layers) + 1

    @property
    def total_units(self) -> int:
        return self.num_rows * self.num_passes

    @property
    def finished(self) -> bool:
        return self.pass_index == self.num_passes


def tower_parts(tower: nn.Module) -> tuple[nn.Module, nn.Module | None, nn.ModuleList]:
    """(embeddings, CLIP's pre-layernorm or None, encoder layers) of a CLIP or SigLIP tower."""
    return tower.embeddings, getattr(tower, "pre_layrnorm", None), tower.encoder.layers


def begin(tower: nn.Module, pixel_values: torch.Tensor, feature_layers: list[int], skip: int,
          out_dim: int) -> ClipSliceState:
    embeddings, pre_norm, layers = tower_parts(tower)
    hidden = embeddings(pixel_values)
    if pre_norm is not None:
        hidden = pre_norm(hidden)
    num_images, rows_per_image, dim = hidden.shape
    hidden = hidden.reshape(-1, dim)
    rows = hidden.shape[0]
    heads = layers[0].self_attn.num_heads
    return ClipSliceState(
        segment_starts=list(range(0, rows + 1, rows_per_image)), rows_per_image=rows_per_image, skip=skip,
        feature_layers=feature_layers, hidden=hidden.contiguous(), next_hidden=torch.empty_like(hidden),
        qkv=hidden.new_empty(3, rows, heads, dim // heads), next_qkv=hidden.new_empty(3, rows, heads, dim // heads),
        merged=hidden.new_empty(rows, out_dim),
    )


def advance(tower: nn.Module, projector: nn.Module, state: ClipSliceState, num_units: int) -> int:
    """Run the next `num_units` row-passes; returns those run (fewer only at the end)."""
    return advance_rows(state, num_units, lambda start, end: _run_rows(tower, projector, state, start, end))


def result(state: ClipSliceState) -> list[torch.Tensor]:
    if not state.finished:
        raise ValueError("the vision tower has not finished these images")
    merged = state.merged.reshape(-1, state.rows_per_image, state.merged.shape[-1])
    return list(merged[:, state.skip:])


def _run_rows(tower: nn.Module, projector: nn.Module, state: ClipSliceState, start: int, end: int) -> None:
    _, _, layers = tower_parts(tower)
    if state.pass_index == 0:
        out = state.hidden[start:end]  # the embeddings, computed by begin
    else:
        layer = layers[state.pass_index - 1]
        attended = segment_attention(state.qkv, state.segment_starts, start, end, layer.self_attn.scale)
        out = state.hidden[start:end] + layer.self_attn.out_proj(attended)
        out = out + layer.mlp(layer.layer_norm2(out))
    state.next_hidden[start:end] = out
    last = max(state.feature_layers)
    if state.pass_index < last:
        if state.pass_index in state.feature_layers:
            kept = state.kept.setdefault(state.pass_index, torch.empty_like(state.hidden))
            kept[start:end] = out
        layer = layers[state.pass_index]
        normed = layer.layer_norm1(out)
        attn = layer.self_attn
        for index, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
            state.next_qkv[index, start:end] = proj(normed).reshape(end - start, attn.num_heads, -1)
    else:
        features = torch.cat([out if k == last else state.kept[k][start:end] for k in state.feature_layers], dim=-1)
        state.merged[start:end] = projector(features)
