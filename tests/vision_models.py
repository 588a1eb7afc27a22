"""Tiny random vision-language checkpoints (LLaVA, Qwen2-VL, Qwen2.5-VL) saved as
Hugging Face directories with a tokenizer and image processor, and test images drawn
with PIL."""

from __future__ import annotations

import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    SiglipImageProcessor,
)

VOCAB_SIZE = 320
# Special tokens at the top of the vocabulary.
IMAGE_PAD, VISION_START, VISION_END, LLAVA_IMAGE = 316, 317, 318, 319
SPECIALS = {"<|image_pad|>": IMAGE_PAD, "<|vision_start|>": VISION_START,
            "<|vision_end|>": VISION_END, "<image>": LLAVA_IMAGE}
CHAT_TEMPLATE = ("{% for m in messages %}t3 {{ m['role'] }} {{ m['content'] }} t4 {% endfor %}"
                 "{% if add_generation_prompt %}t3 assistant {% endif %}")
TEXT = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}


def _qwen_vision(kind: str) -> dict:
    common = {"depth": 2, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_chans": 3}
    if kind == "qwen2_vl":
        return common | {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
    # Window attention over 2x2 merged patches (56 pixels), full attention in block 1.
    return common | {"hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "window_size": 56,
                     "fullatt_block_indexes": [1]}


def build_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llava":  # CLIP; its CLS token's features dropped, the second-to-last layer's taken
        config = LlavaConfig(
            vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 56,
                           "patch_size": 14, "projection_dim": 32},
            text_config={"model_type": "llama", **TEXT}, image_token_id=LLAVA_IMAGE,
            vision_feature_layer=-2)
        model = LlavaForConditionalGeneration(config)
    elif kind == "llava_siglip":  # SigLIP has no CLS token: every patch, the last layer
        config = LlavaConfig(
            vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 56,
                           "patch_size": 14},
            text_config={"model_type": "llama", **TEXT}, image_token_id=LLAVA_IMAGE,
            vision_feature_layer=-1, vision_feature_select_strategy="full")
        model = LlavaForConditionalGeneration(config)
    else:
        config_class, model_class = ((Qwen2VLConfig, Qwen2VLForConditionalGeneration) if kind == "qwen2_vl"
                                     else (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration))
        config = config_class(
            vision_config=_qwen_vision(kind),
            text_config={**TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                     "rope_theta": 10000.0}},
            image_token_id=IMAGE_PAD, video_token_id=315, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, tie_word_embeddings=False)
        model = model_class(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def image_processor(kind: str):
    if kind == "llava_siglip":
        return SiglipImageProcessor(size={"height": 56, "width": 56})
    if kind == "llava":
        return CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    # Dynamic resolution between 4 and 24 merged 28x28 patches.
    return Qwen2VLImageProcessor(min_pixels=4 * 28 * 28, max_pixels=24 * 28 * 28, patch_size=14,
                                 merge_size=2, temporal_patch_size=2)


def save_model(kind: str, directory: str) -> tuple[str, torch.nn.Module]:
    model = build_model(kind)
    model.save_pretrained(directory)
    image_processor(kind).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB_SIZE - len(SPECIALS))} | SPECIALS
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t2", bos_token="t1")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory, model


def drawn_images() -> list[Image.Image]:
    """A gradient, shapes, and text: three sizes, so Qwen2-VL grids differ."""
    gradient = Image.linear_gradient("L").resize((80, 60)).convert("RGB")
    shapes = Image.new("RGB", (100, 70), "white")
    draw = ImageDraw.Draw(shapes)
    draw.ellipse((10, 10, 60, 60), fill="red")
    draw.rectangle((55, 20, 95, 65), fill=(0, 90, 200))
    text = Image.new("RGB", (64, 64), (240, 230, 200))
    ImageDraw.Draw(text).text((4, 25), "kvserve", fill="black")
    return [gradient, shapes, text]


def qwen_image_prompt(num_images: int, lead: int = 3) -> list[int]:
    """`lead` text ids, then per image its vision start, one pad and vision end and a text
    id, then two more text ids (a Qwen2-VL prompt before its pads are expanded)."""
    ids = list(range(10, 10 + lead))
    for i in range(num_images):
        ids += [VISION_START, IMAGE_PAD, VISION_END, 40 + i]
    return ids + [50, 51]


def is_llava(kind: str) -> bool:
    return kind.startswith("llava")


def placeholder_ids(kind: str) -> list[int]:
    return [LLAVA_IMAGE] if is_llava(kind) else [VISION_START, IMAGE_PAD, VISION_END]


def num_image_tokens(kind: str, image: Image.Image) -> int:
    """What the transformers processor expands one image into."""
    if is_llava(kind):
        return (56 // 14) ** 2
    grid = image_processor(kind)(images=[image], return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod()) // 4


def hf_inputs(kind: str, prompt_ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """transformers' model inputs: placeholders expanded as its processor does."""
    pad = LLAVA_IMAGE if is_llava(kind) else IMAGE_PAD
    expanded: list[int] = []
    remaining = list(images)
    for token in prompt_ids:
        if token == pad:
            expanded += [pad] * num_image_tokens(kind, remaining.pop(0))
        else:
            expanded.append(token)
    inputs = {"input_ids": torch.tensor([expanded])}
    if not is_llava(kind):  # what the Qwen2-VL processor returns, read by get_rope_index
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == pad).int()
    if images:
        processed = image_processor(kind)(images=images, return_tensors="pt")
        inputs.update({k: processed[k] for k in ("pixel_values", "image_grid_thw") if k in processed})
    return inputs
