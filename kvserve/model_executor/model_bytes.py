"""What a model's weights take: held in memory, and read by a decode step (the numerator of
its bandwidth floor)."""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig


def weight_bytes_per_step(model: torch.nn.Module, config: ModelConfig) -> int:
    """Every parameter and buffer is read once per step, except an untied input embedding,
    of which a step only gathers one row per token, and a float LM head that a quantized copy
    replaces in decode steps (it serves the larger inputs). Counts quantized weights as stored."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    embedding = model.model.embed_tokens  # None on a pipeline stage without it
    if not config.tie_word_embeddings and embedding is not None:
        tensors.pop(id(embedding.weight))
    if getattr(model, "quantized_lm_head", None) is not None:
        tensors.pop(id(embedding.weight if config.tie_word_embeddings else model.lm_head.weight))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Every parameter and buffer once (a tied LM head is the embedding)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
