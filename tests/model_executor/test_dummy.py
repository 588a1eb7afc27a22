"""Random weights in real model shapes."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_executor.dummy import dummy_model_config
from kvserve.model_executor.loader import load_model


def test_smollm2_dummy_runs(paged_runner) -> None:
    loaded = load_model(None, load_format="dummy", model_shape="smollm2-135m", seed=3)
    assert loaded.tokenizer is None
    assert loaded.config.num_hidden_layers == 30 and loaded.config.tie_word_embeddings
    params = dict(loaded.model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(576))
    assert abs(params["model.embed_tokens.weight"].std().item() - 0.02) < 1e-3
    (logits,) = paged_runner(loaded.model, loaded.config, num_blocks=4).step([(0, [1, 2, 3])])
    assert logits.shape == (3, 49152) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_compute_logits_into_a_given_buffer(quantization) -> None:
    """CUDA graphs hand compute_logits one shared fp32 buffer: the logits land there, the
    same as without it (the bf16 head's and the int8 head copy's alike)."""
    loaded = load_model(None, load_format="dummy", model_shape="smollm2-135m", seed=3,
                        dtype=torch.bfloat16 if quantization is None else torch.float32, quantization=quantization)
    hidden = torch.randn(3, 576, dtype=loaded.config.dtype)
    buffer = torch.full((5, 49152), float("nan"))
    logits = loaded.model.compute_logits(hidden, out=buffer[:3])
    assert logits.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:3], loaded.model.compute_logits(hidden), rtol=0, atol=0)
    assert buffer[:3].dtype == torch.float32 and buffer[3:].isnan().all()


def test_large_shape_configs() -> None:
    llama = dummy_model_config("llama3-8b", torch.bfloat16)
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads,
            llama.num_key_value_heads, llama.head_dim, llama.intermediate_size,
            llama.vocab_size) == (32, 4096, 32, 8, 128, 14336, 128256)
    assert not llama.tie_word_embeddings and llama.rope_theta == 500000.0
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_scaling["factor"] == 8.0
    assert llama.dtype == torch.bfloat16
    qwen = dummy_model_config("qwen2.5-0.5b")
    assert (qwen.num_hidden_layers, qwen.hidden_size, qwen.num_attention_heads,
            qwen.num_key_value_heads, qwen.head_dim, qwen.intermediate_size,
            qwen.vocab_size) == (24, 896, 14, 2, 64, 4864, 151936)
    assert qwen.tie_word_embeddings and qwen.attention_bias and qwen.rope_theta == 1e6


def test_meta_build_of_8b_shape() -> None:
    # Parameter count of the real shape, without allocating it.
    from kvserve.model_executor.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(dummy_model_config("llama3-8b"))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_unknown_shape() -> None:
    with pytest.raises(ValueError, match="llama3-8b"):
        load_model(None, load_format="dummy", model_shape="gpt-5")


@pytest.mark.parametrize("shape,parameters", [
    # The published totals: Mixtral-8x7B 46,702,792,704; Qwen3-30B-A3B 30,532,122,624.
    ("mixtral-8x7b", 46_702_792_704), ("qwen3-30b-a3b", 30_532_122_624)])
def test_meta_build_of_moe_shapes(shape, parameters) -> None:
    from kvserve.model_executor.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(dummy_model_config(shape))
    assert sum(p.numel() for p in model.parameters()) == parameters
