"""Turns the scheduler's decision into one flattened batch and runs the model on it."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.selector import get_attn_backend
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


@dataclass
class StepLogits:
    """Logits of one forward pass, for the positions the engine asked for."""

    # [S, V] fp32: the next-token logits of each sequence that samples this step.
    sample_logits: torch.Tensor
    sampling_seqs: list[Sequence]
    # (sequence, [P, V] logits, index of the first prompt token they predict): prompt
    # positions of this chunk, for requests that asked for prompt logprobs.
    prompt_logits: list[tuple[Sequence, torch.Tensor, int]]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS maps on first write (numpy's calloc): a CPU KV cache then
    costs resident memory only for the blocks in use, not its whole budget up front."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    element_size = torch.empty((), dtype=config.dtype).element_size()
    per_token = 2 * config.num_key_value_heads * config.head_dim * element_size
    return config.num_hidden_layers * block_size * per_token


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.attn_backend = get_attn_backend(
            device, attention_backend, model_config.sliding_window
        )
        model.set_attn_backend(self.attn_backend)
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        self.block_size = cache_config.block_size
        if cache_config.num_blocks is None:
            cache_config.num_blocks = self._determine_num_blocks()
        self.num_blocks = cache_config.num_blocks
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)

    # -- memory ----------------------------------------------------------------------------

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        config = self.model_config
        shape = (2, num_blocks, self.block_size, config.num_key_value_heads, config.head_dim)
        if self.device.type == "cpu":
            return [_lazy_zeros(shape, config.dtype) for _ in range(config.num_hidden_layers)]
        return [
            torch.zeros(shape, dtype=config.dtype, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]

    def _determine_num_blocks(self) -> int:
        bytes_per_block = kv_cache_bytes_per_block(self.model_config, self.block_size)
        if self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        else:
            budget = self.cache_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = int(budget // bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"The KV cache budget ({budget / 2**20:.1f} MiB) does not hold a single block of "
                f"{self.block_size} tokens ({bytes_per_block / 2**20:.2f} MiB); raise "
                "--kv-cache-memory / --gpu-memory-utilization or lower --block-size."
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step the scheduler may build and give what is left to the KV cache."""
        num_tokens = self.scheduler_config.max_num_batched_tokens
        num_profile_blocks = -(-num_tokens // self.block_size)
        caches = self._allocate_kv_caches(num_profile_blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        metadata = self._metadata(
            positions, query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
            block_tables=[list(range(num_profile_blocks))],
        )
        hidden = self.model(input_ids, positions, caches, metadata)
        num_sampled = min(self.scheduler_config.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:num_sampled])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        cache_bytes = sum(cache.numel() * cache.element_size() for cache in caches)
        del caches, hidden
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization) - (peak - cache_bytes)
        logger.info(
            "GPU memory: total %.2f GiB, weights+activations peak %.2f GiB, KV budget %.2f GiB",
            total / 2**30, (peak - cache_bytes) / 2**30, budget / 2**30,
        )
        if budget <= 0:
            raise ValueError(
                f"The model and a {num_tokens}-token step need {(peak - cache_bytes) / 2**30:.2f} "
                f"GiB, more than gpu_memory_utilization={self.cache_config.gpu_memory_utilization} "
                f"of {total / 2**30:.2f} GiB leaves; lower --max-num-batched-tokens or raise "
                "--gpu-memory-utilization."
            )
        return budget

    # -- one step --------------------------------------------------------------------------

    def _metadata(
        self,
        positions: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> AttentionMetadata:
        max_blocks = max(len(table) for table in block_tables)
        padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]
        query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        block_tables_t = torch.tensor(padded, dtype=torch.int32, device=self.device)
        # Each token's cache slot: its sequence's block for the position, plus the offset.
        # output_size is known on the host; without it the GPU would sync to learn it.
        seq_index = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=self.device),
            torch.tensor(query_lens, device=self.device),
            output_size=positions.numel(),
        )
        block_ids = block_tables_t[seq_index, positions // self.block_size].long()
        return AttentionMetadata(
            slot_mapping=block_ids * self.block_size + positions % self.block_size,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=block_tables_t,
            block_size=self.block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepLogits:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_indices: list[int] = []
        sampling_seqs: list[Sequence] = []
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # seq, flat start, count, pos

        for seq in sched.scheduled_seqs:
            start = seq.num_computed_tokens
            end = start + sched.num_scheduled_tokens[seq.seq_id]
            flat_start = len(input_ids)
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            tables.append(block_tables[seq.seq_id])
            if end == seq.num_tokens:
                sample_indices.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1 and seq.index == 0:
                # Position p predicts prompt token p + 1; the last prompt position predicts
                # the first output token, which is not a prompt logprob.
                count = min(end, seq.num_prompt_tokens - 1) - start
                prompt_spans.append((seq, flat_start, count, start))

        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        metadata = self._metadata(positions_t, query_start_loc, seq_lens, tables)
        self._copy_blocks(sched.block_copies)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions_t, self.kv_caches, metadata,
        )
        sample_logits = self.model.compute_logits(hidden[sample_indices])
        prompt_logits = [
            (seq, self.model.compute_logits(hidden[flat : flat + count]), pos + 1)
            for seq, flat, count, pos in prompt_spans
        ]
        return StepLogits(sample_logits, sampling_seqs, prompt_logits)
