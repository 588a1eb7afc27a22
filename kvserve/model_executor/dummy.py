"""Random weights in real model shapes, for speed measurements (like vLLM's
--load-format dummy)."""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model_executor.models.llama import LlamaForCausalLM

_DUMMY_CONFIGS: dict[str, dict] = {
    "llama3-8b": dict(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=[128001, 128008, 128009],
    ),
    "mixtral-8x7b": dict(
        architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
        bos_token_id=1, eos_token_ids=[2],
    ),
    "qwen3-30b-a3b": dict(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        bos_token_id=None, eos_token_ids=[151645, 151643],
    ),
    "qwen2.5-0.5b": dict(
        architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=None, eos_token_ids=[151645, 151643],
    ),
    "smollm2-135m": dict(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=[2],
    ),
}


def dummy_shapes() -> list[str]:
    return sorted(_DUMMY_CONFIGS)


def dummy_model_config(shape: str, dtype: torch.dtype = torch.float32) -> ModelConfig:
    if shape not in _DUMMY_CONFIGS:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(dummy_shapes())}")
    return ModelConfig(**_DUMMY_CONFIGS[shape], dtype=dtype)


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) everywhere except norm weights (1), generated on the model's device."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
