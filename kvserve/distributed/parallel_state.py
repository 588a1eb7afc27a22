"""The process groups of model parallelism, on torch.distributed: NCCL between GPUs, gloo
between CPU processes, and a gloo group beside every device group for plain-data messages
(the step plan). Before any group is built every process is a group of one, whose
collectives return their input: model code calls them unconditionally."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """One process group and this process's place in it."""

    rank_in_group: int = 0
    world_size: int = 1
    device_group: Any = None  # NCCL or gloo: the tensors of the forward pass
    cpu_group: Any = None  # gloo: host objects
    ranks: tuple[int, ...] = (0,)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None) -> torch.Tensor:
        """x's rows exchanged: its i-th block of input_split_sizes[i] rows goes to rank i, and
        the result holds the blocks every rank sent here, in rank order (output_split_sizes[i]
        rows from rank i; None: equal blocks). A block may be empty. Tensors on the CPU travel
        over the gloo group, others over the device group."""
        if self.world_size == 1:
            return x
        rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        out = x.new_empty((rows, *x.shape[1:]))
        group = self.cpu_group if x.device.type == "cpu" else self.device_group
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def send_to_next(self, x: torch.Tensor) -> None:
        """To the next rank of the group (pipeline stages pass the residual stream on)."""
        dist.send(x.contiguous(), self.ranks[self.rank_in_group + 1], group=self.device_group)

    def recv_from_previous(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, self.ranks[self.rank_in_group - 1], group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` from rank `src` of the group (pickled once, sent as one byte tensor)."""
        if self.world_size == 1:
            return obj
        src_global = self.ranks[src]
        if self.rank_in_group == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.long)
            dist.broadcast(size, src_global, group=self.cpu_group)
            dist.broadcast(payload, src_global, group=self.cpu_group)
            return obj
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, src_global, group=self.cpu_group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src_global, group=self.cpu_group)
        return pickle.loads(payload.numpy().tobytes())


_TP = GroupCoordinator()
_PP = GroupCoordinator()
_WORLD = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_world_group() -> GroupCoordinator:
    return _WORLD


def init_distributed_environment(world_size: int, rank: int, init_method: str, device: torch.device) -> None:
    """Join the world: NCCL for CUDA devices, gloo for CPUs."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """Rank r is tensor-parallel rank r % tp of pipeline stage r // tp: a stage's ranks are
    consecutive (on one host, NVLink apart), and pipeline groups join rank i of every stage.
    Every rank builds every group, as torch.distributed requires, and keeps its own."""
    global _TP, _PP, _WORLD
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if world_size != tp * pp:
        raise ValueError(f"{world_size} processes are not tensor_parallel_size x pipeline_parallel_size = {tp} x {pp}")
    gloo = dist.get_backend() == "gloo"
    _WORLD = _coordinator(tuple(range(world_size)), rank, gloo)
    for stage in range(pp):
        ranks = tuple(range(stage * tp, (stage + 1) * tp))
        group = _coordinator(ranks, rank, gloo)
        if rank in ranks:
            _TP = group
    for index in range(tp):
        ranks = tuple(range(index, world_size, tp))
        group = _coordinator(ranks, rank, gloo)
        if rank in ranks:
            _PP = group


def _coordinator(ranks: tuple[int, ...], rank: int, gloo: bool) -> GroupCoordinator:
    device_group = dist.new_group(list(ranks))
    cpu_group = device_group if gloo else dist.new_group(list(ranks), backend="gloo")
    index = ranks.index(rank) if rank in ranks else 0
    return GroupCoordinator(index, len(ranks), device_group, cpu_group, ranks)


def destroy_model_parallel() -> None:
    global _TP, _PP, _WORLD
    _TP, _PP, _WORLD = GroupCoordinator(), GroupCoordinator(), GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
