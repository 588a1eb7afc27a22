"""Megatron-style tensor parallelism of a loaded model: each rank keeps its share of the
attention heads and of the MLP's intermediate rows. q/k/v and gate/up are column-parallel
(this rank's output rows), o_proj and down_proj row-parallel (this rank's input columns,
one all-reduce each), the embedding and LM head vocab-parallel (vocabulary padded to a
multiple of 64 per rank, logits gathered). Every rank's KV cache holds its KV heads only
(a copy of one, where there are fewer KV heads than ranks, as vLLM does).

shard_model cuts a model loaded whole and dense (GGUF files, dummy weights);
sharded_loader.py reads the same share straight from a safetensors checkpoint (one stored
quantized included). Either way each rank quantizes its share where asked (quantize_shard). A mixture of experts splits every expert's rows, or with
expert parallelism gives each rank whole experts; one all-reduce sums the layer, or under
expert parallelism all_to_all sends the tokens to their experts' ranks and back."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.loader import LoadedModel
from kvserve.model_executor.layers.linear import Linear
from kvserve.model_executor.layers.mlp import GatedMLP
from kvserve.model_executor.layers.moe import SparseMoE
from kvserve.quantization.base import QuantizedLinear

VOCAB_PADDING = 64

logger = logging.getLogger(__name__)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_shardable(config: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Raise naming the value that `tp` ranks cannot split, and what would work."""
    sizes = [("attention heads", config.num_attention_heads)]
    if not config.num_experts or config.dense_mlp_layers:
        sizes.append(("MLP intermediate rows", config.intermediate_size))
    if config.num_experts:
        sizes.append(("experts", config.num_experts) if expert_parallel
                     else ("expert intermediate rows", config.moe_intermediate_size))
    if config.shared_expert_intermediate_size:
        sizes.append(("shared-expert intermediate rows", config.shared_expert_intermediate_size))
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"{value} {name} cannot be split over {tp} ranks; "
                             f"use a tensor_parallel_size among {_divisors(value)}")
    kv_heads = config.num_key_value_heads
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{kv_heads} KV heads can be neither split over nor replicated on {tp} ranks; "
                         f"use a tensor_parallel_size that divides {kv_heads} or is a multiple of it")


def _dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A Linear holding exactly these tensors (contiguous, for the CPU kernel)."""
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


class RowParallel(nn.Module):
    """y = sum over ranks of x_rank @ W_rank^T: each rank's `linear` holds in_features / tp
    columns. The linear is a module of its own so that a quantization method applied after
    sharding swaps it like any other; kernels that would fuse a norm into it do not see
    through the wrapper, whose all-reduce must come first."""

    def __init__(self, linear: nn.Module, group: GroupCoordinator) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the (padded) vocabulary; ids elsewhere look up zeros,
    and the all-reduce adds the rank that holds them."""

    def __init__(self, weight: torch.Tensor, start: int, group: GroupCoordinator) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside[:, None], 0))


def vocab_rows_per_rank(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and LM head on each rank, the vocabulary padded to VOCAB_PADDING x tp."""
    return -(-vocab_size // (VOCAB_PADDING * tp)) * VOCAB_PADDING


def rank_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The attention shape one of `tp` ranks holds (what its KV cache is sized by)."""
    # Fewer KV heads than ranks: each rank keeps a copy of the one its query heads read.
    return replace(config, num_attention_heads=config.num_attention_heads // tp,
                   num_key_value_heads=max(1, config.num_key_value_heads // tp))


def _vocab_shard(weight: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, int]:
    """This rank's rows of the vocabulary padded with zero rows to VOCAB_PADDING x tp."""
    per_rank = vocab_rows_per_rank(weight.shape[0], tp)
    start = rank * per_rank
    rows = weight[start : start + per_rank]
    if rows.shape[0] < per_rank:
        rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], weight.shape[1])])
    return rows, start


def _shard_rows(mlp: GatedMLP, rank: int, tp: int, group: GroupCoordinator | None) -> None:
    """This rank's share of a gated MLP's intermediate rows; its down_proj all-reduces over
    `group` (None: the caller sums, as a mixture of experts does once for all of them)."""
    total = mlp.gate_up_proj.out_features // 2
    rows = total // tp
    ours = torch.arange(rank * rows, (rank + 1) * rows)
    mlp.gate_up_proj = _dense(mlp.gate_up_proj.weight[torch.cat([ours, total + ours])])
    down = _dense(mlp.down_proj.weight[:, ours])
    mlp.down_proj = down if group is None else RowParallel(down, group)


def _shard_experts(moe: SparseMoE, group: GroupCoordinator, expert_parallel: bool) -> None:
    """Tensor parallel: a share of every expert's rows. Expert parallel: whole experts, a
    contiguous 1/tp of them per rank (the router stays whole: every rank routes every
    token). Either way the shared expert's rows are split; the layer sums its output over
    the group once, or sends its tokens to their experts' ranks (SparseMoE.set_parallel)."""
    tp, rank = group.world_size, group.rank_in_group
    if expert_parallel:
        per_rank = len(moe.experts) // tp
        for index in range(len(moe.experts)):
            if index // per_rank != rank:
                moe.experts[index] = None
    else:
        for expert in moe.experts:
            _shard_rows(expert, rank, tp, None)
    if hasattr(moe, "shared_expert"):
        _shard_rows(moe.shared_expert, rank, tp, None)
    moe.set_parallel(group, expert_parallel)


@torch.no_grad()
def shard_model(model: nn.Module, group: GroupCoordinator, expert_parallel: bool = False) -> ModelConfig:
    """Cut a loaded LlamaForCausalLM down to this rank's share, in place; returns the rank's
    config (its heads: what its KV cache holds). `expert_parallel`: a mixture of experts'
    layers keep whole experts per rank instead of a share of each."""
    config: ModelConfig = model.config
    tp, rank = group.world_size, group.rank_in_group
    check_shardable(config, tp, expert_parallel)
    if model.quantized_lm_head is not None or any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("shard_model cuts float layers; a checkpoint stored quantized is split while "
                         "loading (sharded_loader.load_rank_share), a float one quantized after sharding")
    shard_config = rank_config(config, tp)
    heads, kv_heads = shard_config.num_attention_heads, shard_config.num_key_value_heads
    first_kv = rank * kv_heads if config.num_key_value_heads >= tp else rank * config.num_key_value_heads // tp
    d = config.head_dim
    q_total, kv_total = config.num_attention_heads * d, config.num_key_value_heads * d
    q_rows = torch.arange(rank * heads * d, (rank + 1) * heads * d)
    kv_rows = torch.arange(first_kv * d, (first_kv + kv_heads) * d)
    qkv_rows = torch.cat([q_rows, q_total + kv_rows, q_total + kv_total + kv_rows])
    for layer in model.model.layers:
        attn = layer.self_attn
        bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[qkv_rows]
        attn.qkv_proj = _dense(attn.qkv_proj.weight[qkv_rows], bias)
        attn.o_proj = RowParallel(_dense(attn.o_proj.weight[:, q_rows]), group)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.q_size, attn.kv_size = heads * d, kv_heads * d
        mlp = getattr(layer, layer.mlp_name)
        if isinstance(mlp, SparseMoE):
            _shard_experts(mlp, group, expert_parallel)
        else:
            _shard_rows(mlp, rank, tp, group)
    if model.model.embed_tokens is not None:  # a pipeline stage may hold neither
        embedding, start = _vocab_shard(model.model.embed_tokens.weight, rank, tp)
        model.model.embed_tokens = VocabParallelEmbedding(embedding, start, group)
    if not config.tie_word_embeddings and model.lm_head is not None:
        model.lm_head = _dense(_vocab_shard(model.lm_head.weight, rank, tp)[0])
    model.tp_group = group
    return shard_config


def quantize_shard(loaded: LoadedModel, quantization: str | None, quantization_config: dict | None,
                   device: torch.device) -> None:
    """A rank's share quantized as a whole model would be: `auto` by the CPU plan, a named
    load-time method by quantize_model (groups run along each shard's own columns)."""
    from kvserve.quantization import get_quantization_method, quantize_model
    from kvserve.quantization.cpu_plan import AUTO, PACKED_GGUF, apply_plan, resolve_auto_quantization

    if quantization == AUTO:
        plan = resolve_auto_quantization(loaded, device)
        if plan.quantization == PACKED_GGUF:
            # The file's blocks make whole layers, not a rank's slices of them.
            logger.info("quantization=auto: a rank's share of a GGUF with K-quant blocks stays in the run dtype")
            return
        apply_plan(loaded, plan)
    elif quantization is not None:
        quantize_model(loaded.model, get_quantization_method(quantization, quantization_config))
