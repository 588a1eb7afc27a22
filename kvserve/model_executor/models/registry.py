"""config.json `architectures` name -> model class."""

from __future__ import annotations

from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.model_executor.models.vision_language import (
    LLAVA,
    QWEN2_5_VL,
    QWEN2_VL,
    LlavaForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

# One implementation covers the family; ModelConfig carries the differences.
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    LLAVA: LlavaForConditionalGeneration,
    QWEN2_VL: Qwen2VLForConditionalGeneration,
    QWEN2_5_VL: Qwen2VLForConditionalGeneration,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        ) from None
