"""Mixtral's sparse mixture of experts: each token runs through the top-k of the layer's
expert MLPs that its router picks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.linear import Linear


class Expert(nn.Module):
    """One SwiGLU MLP under Hugging Face's Mixtral names: w1 gate, w3 up, w2 down. They are
    plain linears, so weight-only quantization and checkpoint loading treat them like any."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """The gate's [experts, hidden] weight, not a Linear: quantizing it would move which
    experts a token picks, so the quantization methods, which swap Linears, leave it alone."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoE(nn.Module):
    """Token choice as Mixtral defines it: a softmax over all experts' router logits in fp32,
    the top_k probabilities renormalised to sum to one, and the token's output the sum of its
    chosen experts' outputs weighted by them. Only the experts some token picked run, each
    on its tokens alone; which ones is read on the host, so a step with this layer does not
    replay as a CUDA graph (ModelConfig.num_experts turns graphs off)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            tokens, slots = torch.where(chosen == expert)
            y = self.experts[expert](x[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out
