"""The embedded SmolLM2 GGUF against transformers' own GGUF loader."""

from __future__ import annotations


import pytest
import torch

from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.loader import LoadedModel


@pytest.fixture(scope="module")
def ours(smollm2_loaded) -> LoadedModel:
    return smollm2_loaded


@pytest.fixture(scope="module")
def reference(smollm2_hf):
    return smollm2_hf


def test_default_model_path() -> None:
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_config_and_tokenizer(ours: LoadedModel) -> None:
    config = ours.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == [ours.tokenizer.eos_token_id] == [2]
    text = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in text


def test_weights_equal_transformers(ours: LoadedModel, reference) -> None:
    views = ours.model.hf_weight_views()
    reference_state = reference.state_dict()
    assert set(views) == set(reference_state) - {"lm_head.weight"}  # tied
    for name, view in views.items():
        assert torch.equal(view, reference_state[name]), name


def test_logits_match_transformers(ours: LoadedModel, reference, paged_runner) -> None:
    tokens = ours.tokenizer("The capital of France is")["input_ids"]
    (logits,) = paged_runner(ours.model, ours.config, num_blocks=8).step([(0, tokens)])
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, -1].float()
    torch.testing.assert_close(logits[-1], expected, atol=1e-3, rtol=0)
