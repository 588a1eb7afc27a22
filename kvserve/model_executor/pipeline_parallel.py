"""Pipeline parallelism of a loaded model: each stage keeps a contiguous run of decoder
layers; the first also the embedding, the last the final norm and the LM head. A stage
takes the residual stream from the one before it and hands its own on (LlamaModel.forward).

The model is loaded whole and then cut down, like tensor_parallel.shard_model."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from kvserve import envs
from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import GroupCoordinator


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) of every stage: KVSERVE_PP_LAYER_PARTITION's counts, or an even split
    whose remainder goes to the first stages."""
    partition = envs.KVSERVE_PP_LAYER_PARTITION
    if partition:
        counts = [int(count) for count in partition.split(",")]
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"KVSERVE_PP_LAYER_PARTITION={partition!r}: needs {num_stages} positive "
                             f"layer counts that add up to the model's {num_layers} layers")
    else:
        if num_stages > num_layers:
            raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers; "
                             f"use at most {num_layers}")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (stage < extra) for stage in range(num_stages)]
    starts = [sum(counts[:stage]) for stage in range(num_stages)]
    return [(start, start + count) for start, count in zip(starts, counts)]


def keep_stage(model: nn.Module, group: GroupCoordinator) -> ModelConfig:
    """Cut a loaded LlamaForCausalLM down to this stage's layers, in place; returns the
    stage's config (its layer count: what its KV cache holds)."""
    config: ModelConfig = model.config
    start, end = stage_layers(config.num_hidden_layers, group.world_size)[group.rank_in_group]
    inner = model.model
    inner.layers = nn.ModuleList(list(inner.layers)[start:end])
    inner.pp_group = group
    if not group.is_first_rank and not (group.is_last_rank and config.tie_word_embeddings):
        inner.embed_tokens = None  # the tied LM head of the last stage is the embedding
    if not group.is_last_rank:
        inner.norm = None
        if not config.tie_word_embeddings:
            model.lm_head = None
    return replace(config, num_hidden_layers=end - start)
