"""config.json `architectures` name -> model class."""

from __future__ import annotations

from kvserve.model_executor.models.llama import LlamaForCausalLM

# One implementation covers the family; ModelConfig carries the differences.
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
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
