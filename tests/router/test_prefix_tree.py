"""The router's approximate prefix tree: longest matches per worker, splits, LRU bounds."""

from __future__ import annotations

import random

from kvserve.router.prefix_tree import PrefixTree


def test_longest_match_names_the_workers_holding_it():
    tree = PrefixTree(max_size_per_tenant=10_000)
    tree.insert("system A: hello", "w1")
    tree.insert("system A: bye", "w2")
    tree.insert("system B", "w2")
    assert tree.match("system A: hello there") == (len("system A: hello"), {"w1"})
    assert tree.match("system A: b") == (len("system A: b"), {"w2"})
    assert tree.match("system A: x") == (len("system A: "), {"w1", "w2"})
    assert tree.match("other") == (0, set())
    assert tree.match((1, 2, 3)) == (0, set())  # token ids never match text


def test_token_id_keys():
    tree = PrefixTree(max_size_per_tenant=10_000)
    tree.insert((1, 2, 3, 4), "w1")
    tree.insert((1, 2, 9), "w2")
    assert tree.match((1, 2, 3, 4, 5)) == (4, {"w1"})
    assert tree.match((1, 2)) == (2, {"w1", "w2"})


def test_sizes_count_each_tenants_characters_once():
    tree = PrefixTree(max_size_per_tenant=10_000)
    tree.insert("abcdef", "w1")
    tree.insert("abcxyz", "w1")
    tree.insert("abcdef", "w1")
    assert tree.size_of["w1"] == len("abcdefxyz")
    tree.insert("abc", "w2")
    assert tree.size_of["w2"] == 3


def test_eviction_drops_least_recently_used_and_keeps_the_bound():
    tree = PrefixTree(max_size_per_tenant=100)
    tree.insert("old-" + "x" * 40, "w1")
    tree.insert("new-" + "y" * 40, "w1")
    tree.insert("newer-" + "z" * 40, "w1")  # over the bound: the oldest goes
    assert tree.size_of["w1"] <= 100
    assert tree.match("old-" + "x" * 40)[0] < 10
    assert tree.match("newer-" + "z" * 40)[0] == 46


def test_remove_tenant_forgets_it_and_keeps_others():
    tree = PrefixTree(max_size_per_tenant=10_000)
    tree.insert("shared prefix one", "w1")
    tree.insert("shared prefix two", "w2")
    tree.remove_tenant("w1")
    assert tree.match("shared prefix one") == (len("shared prefix "), {"w2"})
    assert "w1" not in tree.size_of


def test_random_inserts_keep_tenant_sets_nested_and_sizes_exact():
    rng = random.Random(0)
    tree = PrefixTree(max_size_per_tenant=400)
    for _ in range(500):
        key = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 40)))
        tree.insert(key, rng.choice(["w1", "w2", "w3"]))
    sizes: dict[str, int] = {}
    for node in tree._nodes():
        for child in node.children.values():
            assert set(child.last_access) <= set(node.last_access)
            assert child.last_access, "a node nobody holds is removed"
            for tenant in child.last_access:
                sizes[tenant] = sizes.get(tenant, 0) + len(child.key)
    assert sizes == {t: s for t, s in tree.size_of.items() if s}
    assert all(size <= 400 for size in sizes.values())
