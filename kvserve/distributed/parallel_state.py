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


def get_tp_group() -> GroupCoordinator:
    return _TP


def init_distributed_environment(world_size: int, rank: int, init_method: str, device: torch.device) -> None:
    """Join the world: NCCL for CUDA devices, gloo for CPUs."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_parallel_size: int) -> None:
    """Tensor-parallel groups of consecutive ranks. Every rank builds every group, as
    torch.distributed requires, and keeps its own."""
    global _TP
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % tensor_parallel_size:
        raise ValueError(f"{world_size} processes cannot form groups of tensor_parallel_size={tensor_parallel_size}")
    for start in range(0, world_size, tensor_parallel_size):
        ranks = tuple(range(start, start + tensor_parallel_size))
        device_group = dist.new_group(list(ranks))
        cpu_group = dist.new_group(list(ranks), backend="gloo") if dist.get_backend() != "gloo" else device_group
        if rank in ranks:
            _TP = GroupCoordinator(ranks.index(rank), tensor_parallel_size, device_group, cpu_group, ranks)


def destroy_model_parallel() -> None:
    global _TP
    _TP = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
