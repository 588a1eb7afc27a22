"""An approximate radix tree of the prompts the router sent to each worker.

It mirrors what each worker's prefix cache probably holds, from the router's own routing
history (as SGLang's sgl-router does): every node records, per worker ("tenant"), when a
prompt through it was last routed there. A tenant present at a node is present at all its
ancestors, so the deepest node a prompt reaches names the workers with its longest match.
Each tenant's characters are bounded; beyond the bound its least recently used leaves go.
Keys are str (prompt text) or tuple (token ids): any sequence whose items compare.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    key: Sequence  # the edge label from the parent
    parent: "_Node | None"
    children: dict = field(default_factory=dict)  # first item of the child's key -> child
    last_access: dict[str, float] = field(default_factory=dict)  # tenant -> time


def _common_length(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self, max_size_per_tenant: int) -> None:
        self.root = _Node(key="", parent=None)
        self.max_size_per_tenant = max_size_per_tenant
        self.size_of: dict[str, int] = {}  # tenant -> items it holds in the tree

    def match(self, key: Sequence) -> tuple[int, set[str]]:
        """(length of the longest prefix of key some tenant holds, the tenants holding it)."""
        node, matched = self.root, 0
        tenants: set[str] = set()
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            common = _common_length(child.key, key[matched:matched + len(child.key)])
            if common == 0:
                break
            matched += common
            node = child
            tenants = set(child.last_access)
            if common < len(child.key):
                break
        return matched, tenants

    def insert(self, key: Sequence, tenant: str) -> None:
        now = time.monotonic()
        node, position = self.root, 0
        node.last_access[tenant] = now
        self.size_of.setdefault(tenant, 0)
        while position < len(key):
            child = node.children.get(key[position])
            if child is None:
                child = _Node(key=key[position:], parent=node)
                node.children[key[position]] = child
                child.last_access[tenant] = now
                self.size_of[tenant] += len(child.key)
                break
            common = _common_length(child.key, key[position:position + len(child.key)])
            if common < len(child.key):
                child = self._split(child, common)
            if tenant not in child.last_access:
                self.size_of[tenant] += len(child.key)
            child.last_access[tenant] = now
            node, position = child, position + common
        if self.size_of[tenant] > self.max_size_per_tenant:
            self.evict(tenant, self.max_size_per_tenant * 9 // 10)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge after `at` items; return the new upper node."""
        parent = node.parent
        upper = _Node(key=node.key[:at], parent=parent, last_access=dict(node.last_access))
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def evict(self, tenant: str, target_size: int) -> None:
        """Drop the tenant's least recently used leaves until it holds at most target_size."""
        while self.size_of.get(tenant, 0) > target_size:
            leaves = [n for n in self._nodes() if tenant in n.last_access and n is not self.root
                      and not any(tenant in c.last_access for c in n.children.values())]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_access[tenant])
            for leaf in leaves:
                if self.size_of[tenant] <= target_size:
                    break
                self._remove_tenant(leaf, tenant)

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything routed to a tenant (a worker that went away lost its cache)."""
        for node in self._nodes():
            if tenant in node.last_access and node is not self.root:
                self._remove_tenant(node, tenant)
        self.root.last_access.pop(tenant, None)
        self.size_of.pop(tenant, None)

    def _remove_tenant(self, node: _Node, tenant: str) -> None:
        del node.last_access[tenant]
        self.size_of[tenant] -= len(node.key)
        if not node.last_access and not node.children:
            del node.parent.children[node.key[0]]

    def _nodes(self) -> list[_Node]:
        """Every node, children after their parents' subtrees (deepest first when reversed)."""
        found, stack = [], [self.root]
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found[::-1]
