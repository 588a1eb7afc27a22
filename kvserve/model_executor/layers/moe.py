"""Sparse mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): each token runs through the
top-k of the layer's expert MLPs that its router picks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.layers.mlp import GatedMLP


class Router(nn.Module):
    """A gate's [outputs, hidden] weight, not a Linear: quantizing it would move which
    experts a token picks, so the quantization methods, which swap Linears, leave it alone."""

    def __init__(self, hidden_size: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """Token choice: a softmax over all experts' router logits in fp32, the top_k kept (and,
    with renormalize, scaled to sum to one), the token's output the sum of its chosen
    experts' outputs weighted by them; Qwen2-MoE adds a shared expert, weighted by the
    sigmoid of its own gate, that every token runs. Each expert is a GatedMLP (plain linears,
    so weight-only quantization and checkpoint loading treat them like any). Only the experts
    some token picked run, each on its tokens alone; how many tokens each got is read on the
    host, so a model with this layer runs eagerly (no CUDA graphs, no compiled CPU decode)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Router(hidden_size, 1)
        # Set by tensor_parallel.shard_model: this rank computes a part of every token's
        # output (a share of each expert's rows, or whole experts of its own, the others
        # None), and the parts are summed over the group.
        self.tp_group: GroupCoordinator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # (token, slot) pairs grouped by expert, tokens ascending within each: the counts are
        # the layer's one read on the host (a torch.where per expert would be one each).
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        tokens, weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count and expert is not None:
                rows = tokens[start : start + count]
                y = expert.output(x[rows]) * weights[start : start + count, None]
                out.index_add_(0, rows, y.to(out.dtype))
            start += count
        if hasattr(self, "shared_expert"):
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.output(x)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)
