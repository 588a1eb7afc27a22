"""The layout of one flattened batch as the attention kernels read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """One step's batch: B sequences, T new tokens in total, laid out back to back.

    Sequence i owns new tokens query_start_loc[i]:query_start_loc[i+1]; they sit at the
    last positions of its context of seq_lens[i] tokens (earlier tokens are already in the
    cache). A decode is the case of one new token; a prefill chunk, of several.
    """

    # [T] int64: flat cache slot (block_id * block_size + offset) where each new token's
    # K/V is written.
    slot_mapping: torch.Tensor
    # [B + 1] int32, cumulative count of new tokens per sequence.
    query_start_loc: torch.Tensor
    # [B] int32: context length of each sequence including this step's tokens.
    seq_lens: torch.Tensor
    # [B, max_blocks] int32: physical block of each logical block, padded with 0.
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so reference code can loop without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
