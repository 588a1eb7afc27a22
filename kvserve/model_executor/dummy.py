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


# Qwen2.5-VL-7B-Instruct: its config.json, from which the vision tower is built.
_QWEN2_5_VL_7B_HF_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
        "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
        "tokens_per_second": 2,
    },
    "text_config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128000,
        "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
    },
}
_DUMMY_CONFIGS["qwen2.5-vl-7b"] = dict(
    architecture="Qwen2_5_VLForConditionalGeneration", vocab_size=152064, hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000,
    tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_ids=[151645, 151643],
    hf_config=_QWEN2_5_VL_7B_HF_CONFIG, image_token_id=151655, mrope_section=(16, 24, 24),
)


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
