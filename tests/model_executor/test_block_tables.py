"""A step's block tables packed into one int32 tensor."""

from __future__ import annotations

from array import array

import torch

from kvserve.model_executor.block_tables import pack_block_tables


def _reference(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(table) for table in tables)
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)


def test_lists_arrays_and_a_mix_pad_with_zeros():
    lists = [[5, 3, 9], [7], [2, 11, 4, 8], [6, 1]]
    expected = _reference(lists)
    for tables in (lists, [array("i", t) for t in lists], [array("i", lists[0]), *lists[1:]]):
        packed = pack_block_tables(tables)
        assert packed.dtype == torch.int32 and torch.equal(packed, expected)


def test_large_ids_and_one_table():
    tables = [array("i", [2**31 - 1, 0, 123456])]
    assert pack_block_tables(tables).tolist() == [[2**31 - 1, 0, 123456]]


def test_empty_tables():
    assert pack_block_tables([[], []]).shape == (2, 0)
