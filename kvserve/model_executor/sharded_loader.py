"""A tensor and pipeline parallel rank that reads only its own share of a safetensors
checkpoint. The model is built in the rank's shape (attention heads, MLP rows and
vocabulary rows divided over the tensor-parallel ranks, the stage's layers only, its own
experts under expert parallelism), and each tensor is read with safe_open's get_slice: the
rows or columns the rank keeps and nothing more. The result is what
tensor_parallel.shard_model cuts from the whole model (and pipeline_parallel.keep_stage),
read with about 1/tp of the checkpoint's bytes instead of all of them."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from torch import nn

from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.errors import ModelLoadError
from kvserve.model_executor.layers.moe import SparseMoE
from kvserve.model_executor.loader import (
    LoadedModel,
    hf_model_config,
    materialize,
    read_json,
    safetensors_files,
    stored_quantized,
)
from kvserve.model_executor.models.registry import get_model_class
from kvserve.model_executor.pipeline_parallel import keep_stage, stage_layers
from kvserve.model_executor.tensor_parallel import (
    RowParallel,
    VocabParallelEmbedding,
    check_shardable,
    vocab_rows_per_rank,
)
from kvserve.quantization.checkpoint import CheckpointFormat, CheckpointGrid, GridFormat
from kvserve.quantization.grid import grid_linear
from kvserve.quantization.registry import get_checkpoint_format

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
    """A safetensors directory of a text model: what a rank reads its share of."""
    if model is None or load_format not in ("auto", "safetensors") or not os.path.isdir(model):
        return False
    return "vision_config" not in read_json(os.path.join(model, "config.json"))


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
        if tp == 1:
            return c
        return replace(
            c, num_attention_heads=c.num_attention_heads // tp,
            num_key_value_heads=max(1, c.num_key_value_heads // tp),
            intermediate_size=c.intermediate_size // tp,
            moe_intermediate_size=c.moe_intermediate_size if self.expert_parallel else c.moe_intermediate_size // tp,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size // tp,
            vocab_size=self.vocab_rows,
        )

    def cut_grid(self, name: str, grid: CheckpointGrid) -> CheckpointGrid:
        """This rank's share of linear `name`'s unpacked grid: its rows with their scales
        and zero points, or its columns with the groups they fall in (act order: the columns
        with their g_idx, every group's scale kept, since g_idx indexes them all)."""
        part = self.slice_of(f"{name}.weight", list(grid.q.shape))
        if part is None:
            return grid
        if part.dim == 0:
            rows = slice(part.start, part.stop)
            return replace(grid, q=grid.q[rows], scale=grid.scale[rows], zero=grid.zero[rows])
        columns = slice(part.start, part.stop)
        if not grid.contiguous_groups():
            return replace(grid, q=grid.q[:, columns], g_idx=grid.g_idx[columns])
        if grid.scale.shape[1] == 1:  # one group per row: every column shares it
            return replace(grid, q=grid.q[:, columns], g_idx=None)
        size = grid.group_size
        if part.start % size or part.stop % size:
            raise ValueError(f"{name}: its groups of {size} input columns do not split at the "
                             f"{part.stop - part.start} columns each of {self.tp} ranks holds; use a "
                             "tensor_parallel_size that leaves each rank whole groups")
        groups = slice(part.start // size, part.stop // size)
        return replace(grid, q=grid.q[:, columns], scale=grid.scale[:, groups], zero=grid.zero[:, groups],
                       g_idx=None)

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


def _local_name(name: str, layers: range) -> str | None:
    """The name a stage's model (its `layers` renumbered from 0) gives checkpoint tensor
    `name`; None for another stage's layer."""
    match = _LAYER.match(name)
    if match is None:
        return name
    index = int(match.group(1))
    return f"model.layers.{index - layers.start}.{name[match.end():]}" if index in layers else None


def _checkpoint_name(local: str, layers: range) -> str:
    match = _LAYER.match(local)
    if match is None:
        return local
    return f"model.layers.{int(match.group(1)) + layers.start}.{local[match.end():]}"


def _iter_share(files: list[str], share: RankShare, wanted: set[str], layers: range,
                report: ShardedRead) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, this rank's slice, read from the file) of every tensor the rank wants."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                report.checkpoint_bytes += _nbytes(view)
                local = _local_name(name, layers)
                if local not in wanted:
                    continue  # another stage's layer, another rank's expert, a tied copy
                part = share.slice_of(name, view.get_shape())
                tensor = _read(view, part)
                report.bytes_read += tensor.numel() * tensor.element_size()
                yield local, _pad_rows(tensor, part)


def _read_stage(files: list[str], layers: range, report: ShardedRead) -> dict[str, torch.Tensor]:
    """Every tensor of the stage, whole: a packed layer unpacks whole before it is cut, and
    packed checkpoints are small."""
    tensors = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                report.checkpoint_bytes += _nbytes(view)
                if _local_name(name, layers) is not None:
                    tensors[name] = view[:]
                    report.bytes_read += _nbytes(view)
    return tensors


def _share_in_memory(tensors: dict[str, torch.Tensor], share: RankShare, wanted: set[str],
                     layers: range) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors.items():
        local = _local_name(name, layers)
        if local in wanted:
            part = share.slice_of(name, list(tensor.shape))
            yield local, _pad_rows(_read(tensor, part), part)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _nbytes(view) -> int:
    numel = 1
    for size in view.get_shape():
        numel *= size
    return numel * _DTYPE_BYTES[view.get_dtype()]


def _install_quantized_share(model: nn.Module, fmt: CheckpointFormat, tensors: dict[str, torch.Tensor],
                             share: RankShare, layers: range) -> dict[str, torch.Tensor]:
    """Swap each linear the checkpoint stores quantized for the rank's share of it: each
    shard's packed tensors unpacked to its grid, the grid cut to the rank's rows or columns
    (tensor parallelism) and the layer built from the cut grids as one process builds it
    from whole ones. Returns the exact fp32 weights (local names) of act-order layers,
    which run as float layers."""
    dense: dict[str, torch.Tensor] = {}
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module_name.rsplit(".", 1)[-1] == "lm_head":
            continue
        local_shards = model.hf_shard_names(module_name)
        shards = [_checkpoint_name(local, layers) for local in local_shards]
        if not stored_quantized(module_name, shards, fmt, tensors):
            continue
        if share.tp == 1:
            layer = fmt.linear(tensors, shards, module.bias)
            if layer is None:  # act order: the format put the fp32 weights back
                dense.update({f"{local}.weight": tensors.pop(f"{hf}.weight")
                              for local, hf in zip(local_shards, shards)})
        else:
            if not isinstance(fmt, GridFormat):
                raise ValueError(f"{fmt.quant_method} checkpoints cannot be split over tensor-parallel ranks "
                                 "yet (GPTQ, AWQ and integer compressed-tensors can)")
            grids = [share.cut_grid(hf, fmt.unpack(tensors, hf)) for hf in shards]
            for hf in shards:
                for name in fmt.consumed(tensors, hf):
                    del tensors[name]
            layer = None
            if all(grid.contiguous_groups() for grid in grids):
                layer = grid_linear([grid.to_group_grid() for grid in grids], module.bias)
            else:
                dense.update({f"{local}.weight": grid.dequantize() for local, grid in zip(local_shards, grids)})
        if layer is not None:
            parent, _, attr = module_name.rpartition(".")
            setattr(model.get_submodule(parent), attr, layer)
    return dense


def _rank_model(config: ModelConfig, share: RankShare, pp_group: GroupCoordinator) -> tuple[nn.Module, range]:
    """The rank's model on the meta device: its shapes, its experts, its stage's layers
    (returned: their indices in the checkpoint)."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(share.rank_config()).to(config.dtype)
    for module in model.modules():
        if isinstance(module, SparseMoE):
            for index in range(len(module.experts)):
                if not share.owns_expert(index):
                    module.experts[index] = None
    layers = range(config.num_hidden_layers)
    if pp_group.world_size > 1:
        keep_stage(model, pp_group)
        layers = range(*stage_layers(config.num_hidden_layers, pp_group.world_size)[pp_group.rank_in_group])
    return model, layers


@torch.no_grad()
def load_rank_share(
    model_dir: str, dtype: torch.dtype, device: torch.device, tp_group: GroupCoordinator,
    pp_group: GroupCoordinator, expert_parallel: bool = False,
) -> tuple[LoadedModel, ModelConfig, ShardedRead]:
    """This rank's share of the model in `model_dir`: (the loaded model, whose config is
    the whole model's, without a tokenizer; the config of what the rank holds, its KV
    cache's shape; what it read). A float checkpoint is read a slice per tensor; a
    quantized one (GPTQ, AWQ, compressed-tensors) is read whole for the stage, and each
    packed layer cut after unpacking, its scales and zero points with its rows or columns."""
    config = hf_model_config(model_dir, dtype)
    tp, rank = tp_group.world_size, tp_group.rank_in_group
    check_shardable(config, tp, expert_parallel)
    share = RankShare(config, tp, rank, expert_parallel)
    model, layers = _rank_model(config, share, pp_group)
    files = safetensors_files(model_dir)
    report = ShardedRead()
    config_path = os.path.join(model_dir, "config.json")
    quantization_config = read_json(config_path).get("quantization_config")
    try:
        if quantization_config:
            fmt = get_checkpoint_format(quantization_config, config_path)
            tensors = _read_stage(files, layers, report)
            dense = _install_quantized_share(model, fmt, tensors, share, layers)
            model = materialize(model, device)
            targets = model.hf_weight_views()
            weights = itertools.chain(_share_in_memory(tensors, share, set(targets), layers), dense.items())
        else:
            fmt = None
            model = model.to_empty(device=device).eval()
            targets = model.hf_weight_views()
            weights = _iter_share(files, share, set(targets), layers, report)
        loaded = _copy_into(targets, weights, rank)
    except ValueError as error:
        raise ModelLoadError(f"{model_dir}: {error}") from error
    except (OSError, RuntimeError) as error:
        raise ModelLoadError(f"{model_dir}: corrupt or truncated safetensors file ({error})") from error
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ModelLoadError(f"{model_dir}: missing weights on rank {rank}: {', '.join(missing[:10])}")
    if tp > 1:
        _wrap_parallel(model, tp_group, expert_parallel)
    model.config = config  # the whole vocabulary: compute_logits keeps that much of the gathered logits
    rank_config = share.rank_config()
    rank_shape = replace(config, num_attention_heads=rank_config.num_attention_heads,
                         num_key_value_heads=rank_config.num_key_value_heads, num_hidden_layers=len(layers))
    return LoadedModel(model, config, None, quantization=fmt and fmt.quant_method), rank_shape, report


def _copy_into(targets: dict[str, torch.Tensor], weights: Iterator[tuple[str, torch.Tensor]], rank: int) -> set[str]:
    """Copy each (local name, tensor) into its parameter; returns the names filled."""
    loaded = set()
    for name, tensor in weights:
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)} on rank {rank}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        loaded.add(name)
    return loaded


def _wrap_parallel(model: torch.nn.Module, group: GroupCoordinator, expert_parallel: bool) -> None:
    """The rank's layers summed over the group where shard_model sums them: o_proj and a
    dense down_proj all-reduce, a mixture once for all its experts; the embedding looks up
    its vocabulary rows only; the LM head's logits are gathered."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        mlp = getattr(layer, layer.mlp_name)
        if isinstance(mlp, SparseMoE):
            mlp.set_parallel(group, expert_parallel)
        else:
            mlp.down_proj = RowParallel(mlp.down_proj, group)
    embed = model.model.embed_tokens
    if embed is not None:
        model.model.embed_tokens = VocabParallelEmbedding(embed.weight, group.rank_in_group * embed.weight.shape[0],
                                                          group)
    model.tp_group = group
