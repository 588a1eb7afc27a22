"""CUDA graphs for decode-only steps.

A decode step of a small model, or of a large one at small batch, launches hundreds of
short kernels; the host cannot issue them as fast as the GPU runs them. Capturing the
whole forward pass plus the LM head once per batch size and replaying it costs one launch.

Graphs replay fixed addresses and fixed grids, so each step's inputs are copied into
persistent buffers, a batch is padded up to the next captured size (padding rows write
no KV: slot -1), and the attention's split-KV count is pinned per graph: one graph per
(batch bucket, number of KV splits), captured on first use, the split count rounded down
to a power of two so that few variants exist.
"""

from __future__ import annotations

import logging
import time
from array import array

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.triton_kernels.paged_attention import choose_num_kv_splits

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_batch (which is always included)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return buckets + [max_batch]


def _power_of_two_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class DecodeGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # [bucket, vocab] fp32, rewritten by every replay


class CudaGraphRunner:
    """Runs decode-only batches (one new token per sequence, every sequence sampling) of at
    most max_batch sequences through captured graphs of `model` + `model.compute_logits`."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.num_kv_heads = kv_caches[0].shape[3]
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.num_replays = 0
        self.pool = torch.cuda.graph_pool_handle()
        n = self.max_batch
        # Persistent inputs. int64 rows: token ids, positions, KV slots, copied in one go.
        self.token_inputs = torch.zeros(3, n, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Every sequence has exactly one query token, so the offsets never change.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.staging = torch.zeros(3, n, dtype=torch.long, pin_memory=True)
        self.staging_lens = torch.ones(n, dtype=torch.int32, pin_memory=True)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _metadata(self, bucket: int, max_seq_len: int, num_kv_splits: int | None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.token_inputs[2, :bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=[1] * bucket,
            num_kv_splits=num_kv_splits,
        )

    def _num_kv_splits(self, bucket: int, max_seq_len: int) -> int:
        splits = choose_num_kv_splits(
            self._metadata(bucket, max_seq_len, None), self.num_kv_heads, self.device
        )
        return _power_of_two_floor(splits)

    def _forward(self, bucket: int, num_kv_splits: int) -> torch.Tensor:
        ids, positions = self.token_inputs[0, :bucket], self.token_inputs[1, :bucket]
        metadata = self._metadata(bucket, 1, num_kv_splits)
        hidden = self.model(ids, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    def _capture(self, bucket: int, num_kv_splits: int) -> DecodeGraph:
        # Padding rows, as replays will see them: no KV write, one visible key.
        self.token_inputs[:, :bucket] = 0
        self.token_inputs[2, :bucket] = -1
        self.seq_lens[:bucket] = 1
        start = time.perf_counter()
        # One eager run first: compiles the Triton kernels and settles lazy state
        # (e.g. RoPE tables moved to the device), neither of which may happen in capture.
        self._forward(bucket, num_kv_splits)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bucket, num_kv_splits)
        torch.cuda.synchronize(self.device)
        logger.debug(
            "captured decode graph: batch %d, %d KV splits, %.0f ms",
            bucket, num_kv_splits, (time.perf_counter() - start) * 1e3,
        )
        return DecodeGraph(graph, logits)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture the unsplit graph of every bucket, largest first so that the smaller
        ones reuse its memory pool."""
        start = time.perf_counter()
        for bucket in reversed(self.buckets):
            self.graphs[(bucket, 1)] = self._capture(bucket, 1)
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d) in %.1f s",
            len(self.buckets), self.max_batch, time.perf_counter() - start,
        )

    @torch.inference_mode()
    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """[B, vocab] fp32 next-token logits of B decoding sequences: sequence i feeds
        token_ids[i] at positions[i]. The view is valid until the next run."""
        batch = len(token_ids)
        bucket = self.bucket_for(batch)
        block_size = self.block_size
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, p in zip(block_tables, positions)]
        staging = self.staging
        staging[:, :bucket] = 0
        staging[2, :bucket] = -1
        staging[:, :batch] = torch.tensor([token_ids, positions, slots], dtype=torch.long)
        self.staging_lens[:bucket] = 1
        self.staging_lens[:batch] = torch.tensor(positions, dtype=torch.int32) + 1
        self.token_inputs[:, :bucket].copy_(staging[:, :bucket], non_blocking=True)
        self.seq_lens[:bucket].copy_(self.staging_lens[:bucket], non_blocking=True)
        width = max(len(table) for table in block_tables)
        # One flat int32 array built in C is several times faster than a nested torch.tensor.
        flat = array("i")
        padding = [0] * width
        for table in block_tables:
            flat.extend(table)
            flat.extend(padding[: width - len(table)])
        tables = torch.frombuffer(flat, dtype=torch.int32).view(batch, width)
        self.block_tables[:batch, :width].copy_(tables.pin_memory(), non_blocking=True)

        key = (bucket, self._num_kv_splits(bucket, max(positions) + 1))
        graph = self.graphs.get(key)
        if graph is None:
            # Capturing overwrites the persistent inputs with padding: redo the copies after.
            graph = self.graphs[key] = self._capture(*key)
            return self.run(token_ids, positions, block_tables)
        graph.graph.replay()
        self.num_replays += 1
        return graph.logits[:batch]

    @torch.inference_mode()
    def replay_time_ms(self, batch_size: int, repeats: int = 50) -> float:
        """Device time of this batch size's (unsplit) graph, replayed back to back: a decode
        step with no host work between steps. The inputs are set to padding first, so the
        replays write nothing into the KV cache."""
        graph = self.graphs[(self.bucket_for(batch_size), 1)].graph
        self.token_inputs[2].fill_(-1)
        graph.replay()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
