"""What a model's weights take: held in memory, and read by a decode step (the numerator of
its bandwidth floor)."""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model_executor.layers.moe import SparseMoE


def weight_bytes_per_step(model: torch.nn.Module, config: ModelConfig) -> int:
    """What a batch-1 decode step reads: every parameter and buffer once, except an untied
    input embedding, of which a step only gathers one row per token, a float LM head that a
    quantized copy replaces in decode steps (it serves the larger inputs), and the experts of
    a mixture that the token did not choose (top_k of each layer's experts are read). Counts
    quantized weights as stored."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    embedding = model.model.embed_tokens  # None on a pipeline stage without it
    if not config.tie_word_embeddings and embedding is not None:
        tensors.pop(id(embedding.weight))
    if getattr(model, "quantized_lm_head", None) is not None:
        tensors.pop(id(embedding.weight if config.tie_word_embeddings else model.lm_head.weight))
    unread = expert_weight_bytes(model) * (1 - experts_read_fraction(config, 1))
    return sum(t.numel() * t.element_size() for t in tensors.values()) - round(unread)


def expert_weight_bytes(model: torch.nn.Module) -> int:
    """All the mixture-of-experts layers' experts, as stored (0 for a dense model)."""
    tensors = {id(t): t for layer in model.modules() if isinstance(layer, SparseMoE)
               for expert in layer.experts if expert is not None for t in expert.parameters()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def experts_read_fraction(config: ModelConfig, num_seqs: int) -> float:
    """The expected share of a layer's experts that a decode step of num_seqs tokens reads
    when tokens choose experts uniformly at random: 1 - (1 - top_k / E) ** num_seqs."""
    if not config.num_experts:
        return 1.0
    return 1 - (1 - config.num_experts_per_tok / config.num_experts) ** num_seqs


def decode_step_weight_bytes(batch_1_bytes: int, experts_bytes: int, config: ModelConfig, num_seqs: int) -> int:
    """What a decode step of num_seqs sequences reads (the numerator of its floor), from a
    batch-1 step's bytes (weight_bytes_per_step) and all experts' (expert_weight_bytes)."""
    more = experts_read_fraction(config, num_seqs) - experts_read_fraction(config, 1)
    return batch_1_bytes + round(experts_bytes * more)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Every parameter and buffer once (a tied LM head is the embedding)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
