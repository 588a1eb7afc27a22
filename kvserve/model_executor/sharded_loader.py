"""A tensor and pipeline parallel rank that reads only its own share of a safetensors
checkpoint. The model is built in the rank's shape (attention heads, MLP rows and
vocabulary rows divided over the tensor-parallel ranks, the stage's layers only, its own
experts under expert parallelism), and each tensor is read with safe_open's get_slice: the
rows or columns the rank keeps and nothing more. The result is what
tensor_parallel.shard_model cuts from the whole model (and pipeline_parallel.keep_stage),
read with about 1/tp of the checkpoint's bytes instead of all of them."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open

from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.errors import ModelLoadError
from kvserve.model_executor.layers.moe import SparseMoE
from kvserve.model_executor.loader import LoadedModel, _read_json, _safetensors_files, hf_model_config
from kvserve.model_executor.models.registry import get_model_class
from kvserve.model_executor.pipeline_parallel import keep_stage, stage_layers
from kvserve.model_executor.tensor_parallel import (
    RowParallel,
    VocabParallelEmbedding,
    check_shardable,
    vocab_rows_per_rank,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# Hugging Face linears whose output rows a rank splits (column-parallel) or whose input
# columns it splits (row-parallel), Mixtral's expert names included.
_COLUMN_PARALLEL = {"gate_proj", "up_proj", "w1", "w3"}
_ROW_PARALLEL = {"o_proj", "down_proj", "w2"}


@dataclass(frozen=True)
class RankSlice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a checkpoint tensor, with zero rows
    appended up to `rows` (the vocabulary's padding) where given."""

    dim: int
    start: int
    stop: int
    rows: int | None = None


@dataclass
class ShardedRead:
    """What a rank read of the checkpoint: the bytes of the slices it asked for, and the
    bytes of every tensor in the files (what loading the whole model reads)."""

    bytes_read: int = 0
    checkpoint_bytes: int = 0


def can_load_sharded(model: str | None, load_format: str) -> bool:
    """A float safetensors directory of a text model: what a rank reads its share of."""
    if model is None or load_format not in ("auto", "safetensors") or not os.path.isdir(model):
        return False
    config = _read_json(os.path.join(model, "config.json"))
    return "quantization_config" not in config and "vision_config" not in config


class RankShare:
    """Which slice of each checkpoint tensor rank `rank` of `tp` keeps, as shard_model cuts it."""

    def __init__(self, config: ModelConfig, tp: int, rank: int, expert_parallel: bool) -> None:
        self.config, self.tp, self.rank = config, tp, rank
        self.expert_parallel = expert_parallel
        d = config.head_dim
        self.q_rows = config.num_attention_heads // tp * d
        # Fewer KV heads than ranks: each rank reads the one its query heads use.
        kv_heads = max(1, config.num_key_value_heads // tp)
        first_kv = rank * kv_heads if config.num_key_value_heads >= tp else rank * config.num_key_value_heads // tp
        self.kv_slice = RankSlice(0, first_kv * d, (first_kv + kv_heads) * d)
        self.vocab_rows = vocab_rows_per_rank(config.vocab_size, tp)

    def rank_config(self) -> ModelConfig:
        """The model config whose layers have exactly this rank's shapes."""
        c, tp = self.config, self.tp
        return replace(
            c, num_attention_heads=c.num_attention_heads // tp,
            num_key_value_heads=max(1, c.num_key_value_heads // tp),
            intermediate_size=c.intermediate_size // tp,
            moe_intermediate_size=c.moe_intermediate_size if self.expert_parallel else c.moe_intermediate_size // tp,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size // tp,
            vocab_size=self.vocab_rows,
        )

    def owns_expert(self, index: int) -> bool:
        return not self.expert_parallel or index // (self.config.num_experts // self.tp) == self.rank

    def slice_of(self, name: str, shape: list[int]) -> RankSlice | None:
        """The slice of checkpoint tensor `name` (of `shape`) this rank reads; None: all of it."""
        if self.tp == 1:
            return None
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf in ("embed_tokens", "lm_head"):
            start = self.rank * self.vocab_rows
            return RankSlice(0, min(start, shape[0]), min(start + self.vocab_rows, shape[0]), self.vocab_rows)
        if leaf == "q_proj":
            return RankSlice(0, self.rank * self.q_rows, (self.rank + 1) * self.q_rows)
        if leaf in ("k_proj", "v_proj"):
            return self.kv_slice
        if self.expert_parallel and _EXPERT.search(name):
            return None  # a whole expert of this rank's own
        if leaf in _COLUMN_PARALLEL:
            rows = shape[0] // self.tp
            return RankSlice(0, self.rank * rows, (self.rank + 1) * rows)
        if leaf in _ROW_PARALLEL and kind == "weight":
            columns = shape[1] // self.tp
            return RankSlice(1, self.rank * columns, (self.rank + 1) * columns)
        return None  # norms, routers: every rank reads them whole


def _read(view, part: RankSlice | None) -> torch.Tensor:
    """Slice `part` of a tensor in a safetensors file, read from it (nothing beyond it)."""
    if part is None:
        return view[:]
    return view[part.start : part.stop] if part.dim == 0 else view[:, part.start : part.stop]


def _pad_rows(tensor: torch.Tensor, part: RankSlice | None) -> torch.Tensor:
    if part is None or part.rows is None or tensor.shape[0] == part.rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(part.rows - tensor.shape[0], *tensor.shape[1:])])


def _local_name(name: str, first_layer: int) -> str:
    """The name a stage's model (layers renumbered from 0) gives checkpoint tensor `name`."""
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"model.layers.{int(match.group(1)) - first_layer}.{name[match.end():]}"


def _iter_share(files: list[str], share: RankShare, wanted: set[str], first_layer: int,
                report: ShardedRead) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                report.checkpoint_bytes += _nbytes(view)
                local = _local_name(name, first_layer)
                if local not in wanted:
                    continue  # another stage's layer, another rank's expert, a tied copy
                part = share.slice_of(name, view.get_shape())
                tensor = _read(view, part)
                report.bytes_read += tensor.numel() * tensor.element_size()
                yield local, _pad_rows(tensor, part)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _nbytes(view) -> int:
    numel = 1
    for size in view.get_shape():
        numel *= size
    return numel * _DTYPE_BYTES[view.get_dtype()]


@torch.no_grad()
def load_rank_share(
    model_dir: str, dtype: torch.dtype, device: torch.device, tp_group: GroupCoordinator,
    pp_group: GroupCoordinator, expert_parallel: bool = False,
) -> tuple[LoadedModel, ModelConfig, ShardedRead]:
    """This rank's share of the model in `model_dir`: (the loaded model, whose config is
    the whole model's, without a tokenizer; the config of what the rank holds, its KV
    cache's shape; what it read)."""
    config = hf_model_config(model_dir, dtype)
    tp, rank = tp_group.world_size, tp_group.rank_in_group
    check_shardable(config, tp, expert_parallel)
    share = RankShare(config, tp, rank, expert_parallel)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(share.rank_config() if tp > 1 else config).to(dtype)
    for module in model.modules():
        if isinstance(module, SparseMoE):
            for index in range(len(module.experts)):
                if not share.owns_expert(index):
                    module.experts[index] = None
    first_layer = 0
    if pp_group.world_size > 1:
        keep_stage(model, pp_group)
        first_layer = stage_layers(config.num_hidden_layers, pp_group.world_size)[pp_group.rank_in_group][0]
    model = model.to_empty(device=device).eval()
    targets = model.hf_weight_views()
    report = ShardedRead()
    loaded: set[str] = set()
    try:
        for name, tensor in _iter_share(_safetensors_files(model_dir), share, set(targets), first_layer, report):
            target = targets[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ModelLoadError(f"{model_dir}: weight {name!r} has shape {tuple(tensor.shape)} on rank "
                                     f"{rank}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
    except (OSError, RuntimeError) as error:
        raise ModelLoadError(f"{model_dir}: corrupt or truncated safetensors file ({error})") from error
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ModelLoadError(f"{model_dir}: missing weights on rank {rank}: {', '.join(missing[:10])}")
    if tp > 1:
        _wrap_parallel(model, tp_group)
    model.config = config  # the whole vocabulary: compute_logits keeps that much of the gathered logits
    rank_shape = replace(config, num_attention_heads=share.rank_config().num_attention_heads,
                         num_key_value_heads=share.rank_config().num_key_value_heads)
    if pp_group.world_size > 1:
        start, end = stage_layers(config.num_hidden_layers, pp_group.world_size)[pp_group.rank_in_group]
        rank_shape = replace(rank_shape, num_hidden_layers=end - start)
    return LoadedModel(model, config, None), rank_shape, report


def _wrap_parallel(model: torch.nn.Module, group: GroupCoordinator) -> None:
    """The rank's layers summed over the group where shard_model sums them: o_proj and a
    dense down_proj all-reduce, a mixture once for all its experts; the embedding looks up
    its vocabulary rows only; the LM head's logits are gathered."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        mlp = getattr(layer, layer.mlp_name)
        if isinstance(mlp, SparseMoE):
            mlp.tp_group = group
        else:
            mlp.down_proj = RowParallel(mlp.down_proj, group)
    embed = model.model.embed_tokens
    if embed is not None:
        model.model.embed_tokens = VocabParallelEmbedding(embed.weight, group.rank_in_group * embed.weight.shape[0],
                                                          group)
    model.tp_group = group
