"""Token trees for verification: drafts as nodes with parents, so one target pass can
score several candidate continuations (EAGLE / Medusa style). A linear chain of drafts is
the one-path tree and needs no mask (plain causal attention)."""

from __future__ import annotations

import torch


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each draft node: 0 for a child of the last verified token (parent -1).
    Nodes are in topological order (a parent comes before its children)."""
    depths: list[int] = []
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"tree node {node} has parent {parent}; allowed: -1 <= parent < {node}")
        depths.append(0 if parent == -1 else depths[parent] + 1)
    return depths


def tree_attention_mask(num_prefix_queries: int, parents: list[int], device: torch.device) -> torch.Tensor:
    """[q, q] bool mask over one sequence's query tokens: `num_prefix_queries` verified
    tokens (causal among themselves, seen by every node) followed by the draft nodes, each
    of which sees only itself and its ancestors."""
    num_queries = num_prefix_queries + len(parents)
    mask = torch.ones(num_queries, num_queries, dtype=torch.bool).tril_()
    for node, parent in enumerate(parents):
        row = num_prefix_queries + node
        mask[row, num_prefix_queries:] = False
        mask[row, row] = True
        if parent != -1:
            mask[row, num_prefix_queries:] |= mask[num_prefix_queries + parent, num_prefix_queries:]
    return mask.to(device)
