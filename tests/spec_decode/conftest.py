"""Fixtures for speculative decoding tests: models for drafts on the real SmolLM2, and a tiny
random Llama for draft heads."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_smollm2_draft(smollm2_loaded, tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's tokenizer: a valid but poor draft model, so
    most of its drafts are rejected."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import randomize

    config = LlamaConfig(
        vocab_size=smollm2_loaded.config.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=True, max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    randomize(model, seed=0)
    directory = os.path.join(tmp_path_factory.mktemp("draft"), "tiny-draft")
    model.save_pretrained(directory)
    smollm2_loaded.tokenizer.save_pretrained(directory)
    return directory


# The tiny Llama's vocabulary: random heads' top-3 candidates hit the target's argmax often,
# so tree branches other than the first get accepted.
TINY_VOCAB = 24


def save_tiny_llama(directory: str, **config) -> str:
    """A random Llama of two layers, hidden size 32 and a vocabulary of TINY_VOCAB (`config`
    overrides any of LlamaConfig's values), saved to `directory`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import randomize

    config = {"vocab_size": TINY_VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, **config}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    randomize(model, seed=0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))
