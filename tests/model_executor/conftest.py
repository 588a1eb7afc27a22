"""Helper: a paged KV cache driver for the model (tiny checkpoints live in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.model_executor.models.llama import LlamaForCausalLM

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class PagedRunner:
    """Drives LlamaForCausalLM the way a model runner would: a shuffled pool of small
    blocks, one flat varlen batch per step."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, num_blocks: int = 96,
                 block_size: int = 4, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        # Views of one tensor, as the model runner allocates them (the compiled decode needs it).
        self.kv_caches = list(torch.zeros(config.num_hidden_layers, 2, num_blocks, block_size,
                                          config.num_key_value_heads, config.head_dim, dtype=config.dtype))
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    @torch.inference_mode()  # as the model runner's steps (compiled graphs guard on it)
    def step(self, batch: list[tuple[int, list[int]]], forward: Forward | None = None) -> list[torch.Tensor]:
        """batch: (sequence id, new token ids). Returns each sequence's [new, vocab] logits.
        `forward(input_ids, positions, metadata)`: in place of the model's own (eager) one."""
        input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq_id, tokens in batch:
            start = self.seq_lens.get(seq_id, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.seq_lens[seq_id] = end
        max_blocks = max(len(self.block_tables[s]) for s, _ in batch)
        block_tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for row, (seq_id, _) in enumerate(batch):
            table = self.block_tables[seq_id]
            block_tables[row, : len(table)] = torch.tensor(table)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            block_size=self.block_size,
            max_query_len=max(len(t) for _, t in batch),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        if forward is None:
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata)
        else:
            hidden = forward(torch.tensor(input_ids), torch.tensor(positions), metadata)
        logits = self.model.compute_logits(hidden)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(batch))]


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    return PagedRunner
