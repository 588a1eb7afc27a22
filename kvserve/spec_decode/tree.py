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


def tree_step_inputs(newest_position: int, parents: list[int]) -> tuple[list[int], list[int]]:
    """A tree verify row group as the CUDA graphs take it: the newest token at
    newest_position then its draft nodes, (rotary positions, each row's visibility bits):
    nodes rotate by depth, and each sees itself, its ancestors and the newest token (the
    rows of tree_attention_mask(1, parents) as bits, built without the mask)."""
    positions = [newest_position, *(newest_position + 1 + depth for depth in tree_depths(parents))]
    bits = [1]
    for node, parent in enumerate(parents):
        bits.append(bits[parent + 1] | 1 << (node + 1))
    return positions, bits


def mask_row_bits(mask: torch.Tensor) -> list[int]:
    """Each row of a [q, q] bool mask as int64 bits (bit j: the row sees query token j), the
    Triton attention's form of it; at most 64 columns."""
    num_queries = mask.shape[1]
    if num_queries > 64:
        raise ValueError(f"a token tree of {num_queries} query tokens exceeds the 64 the Triton attention masks")
    weights = 1 << torch.arange(num_queries, dtype=torch.int64)
    return (mask.cpu().long() * weights).sum(dim=1).tolist()


class TokenTree:
    """A static draft tree in the Medusa repository's notation: each node is the path of
    candidate ranks from the root, e.g. (0,) the top-1 token after the newest one, (0, 1)
    the second-ranked token after that. Nodes are kept in depth-first order with the
    top-ranked child first, so the all-top-1 chain occupies nodes 0, 1, 2, ... and an
    accepted chain's KV already sits where the sequence continues."""

    def __init__(self, paths: list[tuple[int, ...]]) -> None:
        paths = [tuple(path) for path in paths]
        known = set(paths)
        for path in paths:
            if not path or any(not isinstance(rank, int) or rank < 0 for rank in path):
                raise ValueError(f"token tree node {path!r}: a path of candidate ranks (integers >= 0)")
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"token tree node {path!r} has no parent {path[:-1]!r} in the tree")
        if len(known) != len(paths):
            raise ValueError("token tree nodes must be distinct")
        self.paths = sorted(paths)  # lexicographic order is depth-first, top rank first
        index = {path: i for i, path in enumerate(self.paths)}
        self.parents = [index[path[:-1]] if len(path) > 1 else -1 for path in self.paths]
        self.ranks = [path[-1] for path in self.paths]
        self.depths = [len(path) - 1 for path in self.paths]

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths) + 1

    @classmethod
    def default(cls, num_nodes: int, max_depth: int, top_k: int = 4) -> TokenTree:
        """`num_nodes` nodes: the top-1 chain as deep as `max_depth` (or the nodes) allow,
        then the second, third, ... candidates at each depth from the shallowest (the most
        likely to be reached), at most `top_k` per parent."""
        chain = [(0,) * d for d in range(1, min(num_nodes, max_depth) + 1)]
        paths = list(chain)
        for rank in range(1, top_k):
            for parent in [()] + chain[:-1]:
                if len(paths) == num_nodes:
                    return cls(paths)
                paths.append(parent + (rank,))
        return cls(paths[:num_nodes])

    def children(self) -> list[list[int]]:
        """Each node's children (index -1's, the root's, last), in rank order."""
        children: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for node, parent in enumerate(self.parents):
            children[parent].append(node)
        return children
