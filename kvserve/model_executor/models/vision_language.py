"""Vision-language models: a vision tower (transformers' own module, loaded with the
checkpoint's weights) whose image embeddings replace the image placeholder tokens'
embeddings in a Llama-family decoder that runs on the paged KV cache.

LLaVA: CLIP/SigLIP vision model + MLP projector + Llama decoder. Qwen2-VL / Qwen2.5-VL: a
vision transformer with a patch merger + a Qwen2 decoder under M-RoPE."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.config import EncoderSlicing, ModelConfig
from kvserve.model_executor.models import llava_vision_slices, qwen_vision_slices
from kvserve.model_executor.models.llama import LlamaForCausalLM

LLAVA = "LlavaForConditionalGeneration"
QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
VISION_LANGUAGE_ARCHITECTURES = (LLAVA, QWEN2_VL, QWEN2_5_VL)


def hf_config_object(hf_config: dict[str, Any]):
    """The transformers config class of a checkpoint's config.json (defaults filled in)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    return AutoConfig.for_model(hf_config["model_type"], **fields)


def text_config_dict(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config.json keys, wherever the checkpoint keeps them (transformers 5
    nests them in text_config; older Qwen2-VL files keep them at the top level), with the
    transformers defaults of what the file leaves out."""
    text = hf_config_object(hf_config).get_text_config().to_dict()
    text["tie_word_embeddings"] = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


def image_token_id(hf_config: dict[str, Any]) -> int:
    for key in ("image_token_id", "image_token_index"):
        if hf_config.get(key) is not None:
            return int(hf_config[key])
    raise ValueError("config.json names no image_token_id")


def encoder_slicing(config: ModelConfig, budget_per_step: int) -> EncoderSlicing | None:
    """How a model's vision tower is spread over steps; None where it runs whole (a budget of
    0, or not a vision-language model)."""
    if budget_per_step <= 0 or config.architecture not in VISION_LANGUAGE_ARCHITECTURES:
        return None
    hf = hf_config_object(config.hf_config or {})
    vision = hf.vision_config
    if config.architecture == LLAVA:
        patches = (vision.image_size // vision.patch_size) ** 2
        rows = patches + (1 if vision.model_type == "clip_vision_model" else 0)  # CLIP's class token
        return EncoderSlicing(budget_per_step, max(_llava_feature_layers(hf)) + 1, 1, rows)
    return EncoderSlicing(budget_per_step, qwen_vision_slices.num_passes(vision.depth),
                          vision.spatial_merge_size**2)


def _llava_feature_layers(hf) -> list[int]:
    """The hidden-state indices (0: the embeddings, i: after i layers) LLaVA's features
    concatenate, negative ones counted from the last."""
    layers = hf.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    num_states = hf.vision_config.num_hidden_layers + 1
    return [layer % num_states for layer in layers]


def _no_init_weights():
    """transformers' context that skips random initialisation (where it moved in 5.x)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


class VisionLanguageModel(LlamaForCausalLM):
    """A decoder plus a vision tower; `encode_images` turns preprocessed images into the
    embeddings their placeholder tokens take."""

    # Checkpoint name prefixes -> ours (transformers 5 names first, then the older ones).
    _RENAMES: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__(config, attn_backend)
        self.hf = hf_config_object(config.hf_config or {})
        # The vision tower is built for real (not on the meta device a loader may build the
        # rest on): its non-persistent buffers (position ids, rotary frequencies) are computed
        # here, kept, and put back after the loader allocates storage (to_empty).
        with torch.device("cpu"), _no_init_weights():  # the checkpoint's weights replace them
            self._build_vision()
        self._vision_buffers = {name: buffer.clone() for name, buffer in self.named_buffers()}

    def _build_vision(self) -> None:
        raise NotImplementedError

    def to_empty(self, *, device, recurse: bool = True):  # type: ignore[override]
        module = super().to_empty(device=device, recurse=recurse)
        with torch.no_grad():
            for name, buffer in self.named_buffers():
                if name in self._vision_buffers:
                    buffer.copy_(self._vision_buffers[name])
        return module

    def _vision_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """A preprocessed image tensor (on the host) as the vision tower takes it."""
        param = next(self.vision_modules().parameters())
        return tensor.to(device=param.device, dtype=param.dtype)

    def vision_modules(self) -> nn.Module:
        raise NotImplementedError

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [placeholder tokens, hidden] embedding per preprocessed image, encoded in
        one batched pass."""
        raise NotImplementedError

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for prefix, ours in self._RENAMES:
                if name.startswith(prefix):
                    name = ours + name[len(prefix):]
                    break
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))


class LlavaForConditionalGeneration(VisionLanguageModel):
    _RENAMES = (
        ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
    )

    def _build_vision(self) -> None:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.vision_tower = AutoModel.from_config(self.hf.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(self.hf)

    def vision_modules(self) -> nn.Module:
        return self.vision_tower

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = self._vision_input(torch.cat([image["pixel_values"] for image in images]))
        out = self.vision_tower(pixels, output_hidden_states=True)
        layers = self.hf.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else layers
        # The "default" strategy drops the CLS token's features.
        skip = 1 if self.hf.vision_feature_select_strategy == "default" else 0
        features = torch.cat([out.hidden_states[layer][:, skip:] for layer in layers], dim=-1)
        return list(self.multi_modal_projector(features).to(self.config.dtype))

    # The same tower a slice at a time (llava_vision_slices.py).
    def begin_encoding(self, images: list[dict[str, torch.Tensor]]) -> llava_vision_slices.ClipSliceState:
        pixels = self._vision_input(torch.cat([image["pixel_values"] for image in images]))
        skip = 1 if self.hf.vision_feature_select_strategy == "default" else 0
        out_dim = self.multi_modal_projector.linear_2.out_features
        return llava_vision_slices.begin(self.vision_tower, pixels, _llava_feature_layers(self.hf), skip, out_dim)

    def advance_encoding(self, state: llava_vision_slices.ClipSliceState, num_units: int) -> int:
        return llava_vision_slices.advance(self.vision_tower, self.multi_modal_projector, state, num_units)

    def finish_encoding(self, state: llava_vision_slices.ClipSliceState) -> list[torch.Tensor]:
        return [embedding.to(self.config.dtype) for embedding in llava_vision_slices.result(state)]


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    _RENAMES = (
        ("model.language_model.", "model."), ("model.visual.", "visual."),
    )

    def _build_vision(self) -> None:
        if self.config.architecture == QWEN2_5_VL:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as VisionTransformer,
            )
        else:
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VisionTransformerPretrainedModel as VisionTransformer,
            )
        self.visual = VisionTransformer._from_config(self.hf.vision_config)

    def vision_modules(self) -> nn.Module:
        return self.visual

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        if self.visual.device.type == "cuda":
            # The sliced pass in one go: one variable-length attention call a block, where
            # transformers' tower (without flash-attn) calls attention once per window.
            state = self.begin_encoding(images)
            self.advance_encoding(state, state.total_units)
            return self.finish_encoding(state)
        pixels = self._vision_input(torch.cat([image["pixel_values"] for image in images]))
        grid_thw = torch.cat([image["image_grid_thw"] for image in images]).to(pixels.device)
        merged = self.visual(pixels, grid_thw=grid_thw).pooler_output
        sizes = (grid_thw.prod(-1) // self.visual.spatial_merge_size**2).tolist()
        return list(merged.to(self.config.dtype).split(sizes))

    # The same tower a slice at a time (qwen_vision_slices.py): the batch's state, its next
    # `num_units` row-passes, and the embeddings once it has finished.
    def begin_encoding(self, images: list[dict[str, torch.Tensor]]) -> qwen_vision_slices.VisionSliceState:
        pixels = self._vision_input(torch.cat([image["pixel_values"] for image in images]))
        grid_thw = torch.cat([image["image_grid_thw"] for image in images]).to(pixels.device)
        return qwen_vision_slices.begin(self.visual, pixels, grid_thw)

    def advance_encoding(self, state: qwen_vision_slices.VisionSliceState, num_units: int) -> int:
        return qwen_vision_slices.advance(self.visual, state, num_units)

    def finish_encoding(self, state: qwen_vision_slices.VisionSliceState) -> list[torch.Tensor]:
        return [embedding.to(self.config.dtype) for embedding in qwen_vision_slices.result(state)]
