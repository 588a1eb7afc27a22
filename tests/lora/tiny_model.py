"""A random tiny Llama saved as safetensors, with PEFT adapters of it, for LoRA engine tests."""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.lora import LoRARequest
from tests.conftest import randomize, save_tokenizer
from tests.lora.peft_adapters import make_adapter

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def save_tiny_llama(directory: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    randomize(model, seed=0)
    model.save_pretrained(directory)
    save_tokenizer(directory, VOCAB)
    return model


def save_adapters(base: LlamaForCausalLM, directory: str, ranks: list[int]) -> list[LoRARequest]:
    """One adapter per rank (ids 1, 2, ...), each on all seven projections."""
    requests = []
    for index, rank in enumerate(ranks, start=1):
        path = os.path.join(directory, f"adapter{index}")
        make_adapter(base, path, rank, seed=index)
        requests.append(LoRARequest(f"adapter{index}", index, path))
    return requests


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
