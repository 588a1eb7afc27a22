"""Qwen2-VL / Qwen2.5-VL's vision tower run a slice at a time, so that encoding an image can
be spread over several engine steps while the text streams keep decoding.

The tower is walked in passes over the packed patch rows of a batch of images: pass 0 embeds
patches and projects the first block's queries, keys and values; pass p (1..depth) runs block
p-1's attention and MLP on the rows and projects the next block's q/k/v (or, after the last
block, applies the patch merger). Every pass is row-wise once the q/k/v of the whole block
are known, so a slice is any run of rows (whole merge groups) of the current pass, and the
cost of a slice is its rows. The state kept between slices is the hidden rows, the current
and next blocks' q/k/v, and the merged output: a few times the image's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.models.vision_slices import advance_rows, segment_attention


@dataclass
class VisionSliceState:
    """One batch of images part way through the tower."""

    pixels: torch.Tensor  # [rows, patch values], in attention order (windows for 2.5)
    cos: torch.Tensor  # [rows, head dim], rotary angles in attention order
    sin: torch.Tensor
    segment_starts: list[list[int]]  # per block: starts of its attention segments, then rows
    restore: torch.Tensor | None  # merged rows back to image order (window attention)
    merged_sizes: list[int]  # merged rows (placeholder tokens) per image
    hidden: torch.Tensor  # [rows, dim]: the current block's input
    next_hidden: torch.Tensor  # its output, filled as rows are processed
    qkv: torch.Tensor  # [3, rows, heads, head dim] of the current block
    next_qkv: torch.Tensor  # of the next block, filled as rows are processed
    merged: torch.Tensor  # [rows / merge unit, out dim]
    num_passes: int
    pass_index: int = 0
    row: int = 0

    @property
    def num_rows(self) -> int:
        return self.pixels.shape[0]

    @property
    def total_units(self) -> int:
        return self.num_rows * self.num_passes

    @property
    def done_units(self) -> int:
        return self.pass_index * self.num_rows + self.row

    @property
    def finished(self) -> bool:
        return self.pass_index == self.num_passes


def num_passes(depth: int) -> int:
    """Passes over the rows: the patch embedding, then one per block."""
    return depth + 1


def begin(visual: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionSliceState:
    """The state before any slice runs: rotary angles, attention segments and, for window
    attention, the row order; no patch is embedded yet."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    config = visual.config
    unit = visual.spatial_merge_size**2
    rows = pixel_values.shape[0]
    position_ids = get_vision_position_ids(grid_thw, visual.spatial_merge_size)
    cos, sin = visual.rotary_pos_emb(pixel_values, position_ids)
    full = get_vision_cu_seqlens(grid_thw).tolist()
    segments = [full] * config.depth
    restore = None
    if hasattr(visual, "fullatt_block_indexes"):  # Qwen2.5-VL: window attention between full ones
        from transformers.vision_utils import get_vision_window_index

        window_index, cu_window = get_vision_window_index(
            grid_thw, visual.spatial_merge_size, visual.window_size, visual.patch_size)
        order = (window_index[:, None] * unit + torch.arange(unit, device=window_index.device)).reshape(-1)
        order = order.to(pixel_values.device)
        pixel_values, cos, sin = pixel_values[order], cos[order], sin[order]
        windows = cu_window.tolist()
        segments = [full if i in visual.fullatt_block_indexes else windows for i in range(config.depth)]
        restore = torch.argsort(window_index).to(pixel_values.device)
    block = visual.blocks[0]
    dim, heads = block.attn.qkv.in_features, block.attn.num_heads
    dtype, device = block.attn.qkv.weight.dtype, block.attn.qkv.weight.device
    out_dim = visual.merger.mlp[-1].out_features
    return VisionSliceState(
        pixels=pixel_values, cos=cos, sin=sin, segment_starts=segments, restore=restore,
        merged_sizes=(grid_thw.prod(-1) // unit).tolist(),
        hidden=torch.empty(rows, dim, dtype=dtype, device=device),
        next_hidden=torch.empty(rows, dim, dtype=dtype, device=device),
        qkv=torch.empty(3, rows, heads, dim // heads, dtype=dtype, device=device),
        next_qkv=torch.empty(3, rows, heads, dim // heads, dtype=dtype, device=device),
        merged=torch.empty(rows // unit, out_dim, dtype=dtype, device=device),
        num_passes=num_passes(config.depth),
    )


def advance(visual: nn.Module, state: VisionSliceState, num_units: int) -> int:
    """Run the next `num_units` row-passes (whole merge groups); returns those run (fewer
    only when the tower finishes)."""
    unit = visual.spatial_merge_size**2
    if num_units % unit:
        raise ValueError(f"a slice is whole merge groups of {unit} rows, got {num_units}")
    return advance_rows(state, num_units, lambda start, end: _run_rows(visual, state, start, end))


def result(state: VisionSliceState) -> list[torch.Tensor]:
    """Each image's merged embeddings, once the last pass has run."""
    if not state.finished:
        raise ValueError("the vision tower has not finished these images")
    merged = state.merged if state.restore is None else state.merged[state.restore]
    return list(merged.split(state.merged_sizes))


def _run_rows(visual: nn.Module, state: VisionSliceState, start: int, end: int) -> None:
    depth = len(visual.blocks)
    if state.pass_index == 0:
        # After this pass the hidden rows are the first block's input (buffers swap).
        out = _embed_patches(visual.patch_embed.proj, state.pixels[start:end])
    else:
        block = visual.blocks[state.pass_index - 1]
        attended = segment_attention(state.qkv, state.segment_starts[state.pass_index - 1], start, end,
                                     block.attn.scaling)
        out = state.hidden[start:end] + block.attn.proj(attended)
        out = out + block.mlp(block.norm2(out))
    state.next_hidden[start:end] = out
    if state.pass_index < depth:
        _project_qkv(visual.blocks[state.pass_index], out, state, start, end)
    else:
        unit = visual.spatial_merge_size**2
        state.merged[start // unit: end // unit] = visual.merger(out)


def _embed_patches(proj: nn.Conv3d, pixels: torch.Tensor) -> torch.Tensor:
    """The patch embedding's Conv3d (its kernel is its stride, one output per patch) as the
    matmul it is: the convolution's small-batch CPU kernel costs several times more per row."""
    weight = proj.weight.reshape(proj.out_channels, -1)
    return F.linear(pixels.to(weight.dtype), weight, proj.bias)


def _project_qkv(block: nn.Module, hidden: torch.Tensor, state: VisionSliceState, start: int, end: int) -> None:
    attn = block.attn
    projected = attn.qkv(block.norm1(hidden)).reshape(end - start, 3, attn.num_heads, -1)
    if hidden.is_cuda:  # rotated in place, one kernel each (transformers' fp32 rotary: ~10 kernels)
        from kvserve.ops.elementwise import rotary_

        state.next_qkv[:, start:end] = projected.permute(1, 0, 2, 3)
        half = state.cos.shape[1] // 2  # the angles' two halves are equal (rotate_half)
        cos, sin = state.cos[start:end, :half], state.sin[start:end, :half]
        rotary_(state.next_qkv[0, start:end], cos, sin)
        rotary_(state.next_qkv[1, start:end], cos, sin)
        return
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    q, k, v = projected.permute(1, 0, 2, 3)
    q, k = apply_rotary_pos_emb_vision(q, k, state.cos[start:end], state.sin[start:end])
    state.next_qkv[0, start:end], state.next_qkv[1, start:end], state.next_qkv[2, start:end] = q, k, v
