"""A prompt's images through the model's own transformers image processor (resizing,
normalisation, Qwen2-VL's dynamic resolution within min/max pixels): each image's single
placeholder token in the prompt becomes as many placeholder tokens as the encoder will
produce embeddings, and the image's tensors travel with the request."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from kvserve.multimodal.inputs import ImageFeature, hash_image

# The text a chat message's image part becomes, by architecture: what the model's own
# chat template writes for an image (one placeholder token, expanded by `process`).
_PLACEHOLDER_TEXT = {
    "LlavaForConditionalGeneration": "<image>",
    "Qwen2VLForConditionalGeneration": "<|vision_start|><|image_pad|><|vision_end|>",
    "Qwen2_5_VLForConditionalGeneration": "<|vision_start|><|image_pad|><|vision_end|>",
}


class ImageProcessing:
    def __init__(self, architecture: str, hf_config: dict[str, Any], image_token_id: int,
                 image_processor: Any) -> None:
        self.architecture = architecture
        self.hf_config = hf_config
        self.image_token_id = image_token_id
        self.image_processor = image_processor
        self.placeholder_text = _PLACEHOLDER_TEXT[architecture]

    @classmethod
    def for_model(cls, model_dir: str | None, architecture: str, hf_config: dict[str, Any],
                  image_token_id: int) -> ImageProcessing:
        """The processor saved with the model (preprocessor_config.json); without one (dummy
        weights in a named shape), the architecture's default processor."""
        from transformers import AutoImageProcessor, CLIPImageProcessor, Qwen2VLImageProcessor

        if model_dir is not None and os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            processor = AutoImageProcessor.from_pretrained(model_dir)
        elif architecture == "LlavaForConditionalGeneration":
            size = int(hf_config["vision_config"]["image_size"])
            processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        else:
            processor = Qwen2VLImageProcessor()
        return cls(architecture, hf_config, image_token_id, processor)

    @property
    def spatial_merge_size(self) -> int:
        return int(self.hf_config.get("vision_config", {}).get("spatial_merge_size", 1))

    def _num_tokens(self, tensors: dict[str, torch.Tensor]) -> int:
        """Embeddings the encoder produces for one preprocessed image."""
        grid = tensors.get("image_grid_thw")
        if grid is not None:  # Qwen2-VL: patches, merged spatial_merge_size^2 at a time
            return int(grid.prod()) // self.spatial_merge_size**2
        vision = self.hf_config["vision_config"]
        # The encoder's outputs: one per patch, plus CLIP's CLS token (SigLIP has none);
        # LLaVA's "default" strategy drops the first output, "full" keeps them all.
        outputs = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
        outputs += vision.get("model_type", "clip_vision_model") == "clip_vision_model"
        full = self.hf_config.get("vision_feature_select_strategy", "default") == "full"
        return outputs if full else outputs - 1

    def preprocess(self, image: Image.Image) -> tuple[dict[str, torch.Tensor], int]:
        """(the image processor's tensors, placeholder tokens) of one image."""
        out = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        tensors = {key: out[key] for key in ("pixel_values", "image_grid_thw") if key in out}
        return tensors, self._num_tokens(tensors)

    def process(self, prompt_token_ids: Sequence[int],
                images: Sequence[Image.Image]) -> tuple[list[int], list[ImageFeature]]:
        """(token ids with each image's placeholder expanded, the images' features)."""
        slots = [i for i, token in enumerate(prompt_token_ids) if token == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} image placeholder(s) ({self.placeholder_text!r}) "
                f"but {len(images)} image(s) were given"
            )
        token_ids: list[int] = []
        features: list[ImageFeature] = []
        previous = 0
        for slot, image in zip(slots, images):
            token_ids.extend(prompt_token_ids[previous:slot])
            tensors, length = self.preprocess(image)
            features.append(ImageFeature(hash_image(image), len(token_ids), length, tensors))
            token_ids.extend([self.image_token_id] * length)
            previous = slot + 1
        token_ids.extend(prompt_token_ids[previous:])
        return token_ids, features


def mrope_positions(num_tokens: int, features: Sequence[ImageFeature],
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's 3-D positions of a prompt, [3, num_tokens], and the delta by which every
    later token's position (all three coordinates equal) exceeds its index. Text advances
    all three by one; an image's tokens take (0, row, column) of its merged grid offset by
    the position after the text before it, and the text after it resumes past the grid's
    largest coordinate."""
    positions = torch.empty(3, num_tokens, dtype=torch.long)
    next_position = 0
    index = 0
    for feature in sorted(features, key=lambda f: f.offset):
        text = feature.offset - index
        positions[:, index:feature.offset] = torch.arange(next_position, next_position + text)
        next_position += text
        t, h, w = feature.grid_thw  # type: ignore[misc]
        h, w = h // spatial_merge_size, w // spatial_merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        positions[:, feature.offset:feature.end] = grid.reshape(3, -1) + next_position
        next_position += max(t, h, w)
        index = feature.end
    positions[:, index:] = torch.arange(next_position, next_position + num_tokens - index)
    return positions, next_position + num_tokens - index - num_tokens
