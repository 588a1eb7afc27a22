"""CUDA graphs for decode-only steps and speculative verify steps.

A decode step of a small model, or of a large one at small batch, launches hundreds of
short kernels; the host cannot issue them as fast as the GPU runs them. Capturing the
whole forward pass plus the LM head once per batch size and replaying it costs one launch.

Graphs replay fixed addresses and fixed grids, so each step's inputs are copied into
persistent buffers, a batch is padded up to the next captured size (padding rows write
no KV: slot -1), and the attention's plan (split-KV count and key tile) is pinned per
graph: one graph per (batch bucket, plan), the split count rounded down to a power of two
so that few variants exist. Every plan of the contexts the short-context plan serves (up to
SHORT_CONTEXT keys, verify widths SHORT_VERIFY_CONTEXT) is captured at start; longer
contexts' split plans on first use.

A verify step feeds each sequence its newest token plus up to k drafts: the same shape
with a query width q = 1 + k per sequence. A sequence with fewer drafts is padded at the
end of its row group (padding tokens come after its real ones, so causal attention keeps
them out of the real rows, and they write no KV). A token tree's drafts take their
rotary positions by depth and their tree mask as per-token visibility bits, inputs of the
graph like the token ids (a chain's bits are all set: causal alone). Graphs are keyed by
(batch bucket, query width, attention plan). Verify steps run only at the batch sizes that
speculate (max_verify_batch), so only those buckets capture the wider graphs at start.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.model_executor.block_tables import BlockTable, pack_block_tables
from kvserve.ops.attention.paged_attention import (
    SHORT_CONTEXT,
    SHORT_VERIFY_CONTEXT,
    DecodePlan,
    choose_decode_plan,
)

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_batch (which is always included)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return buckets + [max_batch]


def _power_of_two_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


GraphKey = tuple[int, int, DecodePlan]  # (batch bucket, query width, attention plan)


def graph_plan(bucket: int, width: int, max_seq_len: int, num_kv_heads: int, kv_cache_dtype: torch.dtype,
               device: torch.device) -> DecodePlan:
    """The attention plan pinned in the graph of a step of `bucket` sequences, `width` query
    tokens each, the longest holding max_seq_len keys."""
    metadata = AttentionMetadata(
        slot_mapping=None, query_start_loc=None, seq_lens=None, block_tables=None, block_size=1,
        max_query_len=width, max_seq_len=max_seq_len,
        query_start_loc_cpu=list(range(0, bucket * width + 1, width)), seq_lens_cpu=[width] * bucket,
    )
    plan = choose_decode_plan(metadata, num_kv_heads, kv_cache_dtype, device)
    return plan._replace(num_kv_splits=_power_of_two_floor(plan.num_kv_splits))


def graphs_at_start(buckets: list[int], max_width: int, max_verify_batch: int, num_kv_heads: int,
                    kv_cache_dtype: torch.dtype, device: torch.device) -> list[GraphKey]:
    """The graphs every step over short contexts takes: decode steps of every bucket up to
    SHORT_CONTEXT keys, verify widths of the buckets that speculate (up to max_verify_batch
    sequences) up to SHORT_VERIFY_CONTEXT. Most tokens first, so that the smaller graphs reuse
    their memory."""
    # The bucket a batch of max_verify_batch sequences pads to, and every one below it.
    largest_verify_bucket = next((b for b in buckets if b >= max_verify_batch), buckets[-1]) if max_verify_batch else 0
    keys = set()
    for bucket in buckets:
        for width in range(1, max_width + 1 if bucket <= largest_verify_bucket else 2):
            context = SHORT_CONTEXT if width == 1 else SHORT_VERIFY_CONTEXT
            # choose_decode_plan's thresholds (tiles of 32 keys, splits of 256, context limits)
            # all fall on a multiple of 16 or one past it: those lengths see every plan.
            seq_lens = [width, *(n for n in range(width + 1, context + 1) if n % 16 <= 1)]
            keys |= {(bucket, width, graph_plan(bucket, width, seq_len, num_kv_heads, kv_cache_dtype, device))
                     for seq_len in seq_lens}
    return sorted(keys, key=lambda key: (-key[0] * key[1], -key[0], repr(key[2])))


class DecodeGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.graph = graph
        # [bucket * width, vocab] fp32: a view of the runner's one logits buffer, which every
        # replay of every graph rewrites. (One output per graph would keep each graph's
        # logits allocated in the pool: 4 GiB for llama3-8b's 78 decode graphs.)
        self.logits = logits
        # [bucket * width, hidden]: the last layer's hidden states, where the capture left
        # them (held, so the pool never gives the memory to another graph; each replay
        # rewrites it): what draft heads read, without a copy in the graph. None where the
        # engine does not speculate.
        self.hidden = hidden


class CudaGraphRunner:
    """Runs decode and verify batches (each sequence feeds its newest token plus at most
    max_width - 1 drafts, every query token samples) of at most max_batch sequences
    through captured graphs of `model` + `model.compute_logits`."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
        max_width: int = 1,
        max_verify_batch: int | None = None,
    ) -> None:
        """`max_verify_batch`: the largest batch a verify step (width > 1) may have (None:
        max_batch); larger ones run eagerly."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.num_kv_heads = kv_caches[0].shape[3]
        self.kv_cache_dtype = kv_caches[0].dtype
        self.max_width = max_width
        self.max_verify_batch = self.max_batch if max_verify_batch is None else min(max_verify_batch, self.max_batch)
        verify_rows = self.bucket_for(self.max_verify_batch) * max_width if self.max_verify_batch else 0
        self.logits_rows = max(self.max_batch, verify_rows)
        self.logits: torch.Tensor | None = None  # [logits_rows, vocab] fp32, at the first capture
        self.graphs: dict[GraphKey, DecodeGraph] = {}
        self.replays: Counter[GraphKey] = Counter()  # replays of each graph
        self.last_key: GraphKey | None = None  # the graph the last run replayed
        self._last_rows: slice | torch.Tensor = slice(0, 0)  # its rows that are the batch's, in order
        # (start, end) CUDA events around each replay while a benchmark times the served
        # graphs (a list: served_replay_ms); None: replays are not timed.
        self.replay_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self.pool = torch.cuda.graph_pool_handle()
        n = self.max_batch
        # Persistent inputs. int64 rows: token ids, rotary positions, KV slots, and each
        # token's tree visibility bits (verify steps), copied in one go.
        self.token_inputs = torch.zeros(4, n * max_width, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # Padding tokens of a verify row group sit past the sequence's last block: the
        # extra columns keep their (unused) block lookups inside the table.
        extra_blocks = -(-max_width // block_size)
        self.block_tables = torch.zeros(
            n, max_blocks_per_seq + extra_blocks, dtype=torch.int32, device=device
        )
        # Every sequence has exactly `width` query tokens, so each width's offsets are fixed.
        self.query_start_locs = {
            width: torch.arange(0, n * width + 1, width, dtype=torch.int32, device=device)
            for width in range(1, max_width + 1)
        }
        # Host staging, two sets used in turn: with overlapped scheduling the next step's
        # inputs are written while the copy of this step's may still wait in the stream.
        self.stagings = [
            (torch.zeros(4, n * max_width, dtype=torch.long, pin_memory=True),
             torch.ones(n, dtype=torch.int32, pin_memory=True))
            for _ in range(2)
        ]
        self.num_runs = 0

    def can_run(self, batch_size: int, width: int = 1) -> bool:
        if width == 1:
            return batch_size <= self.max_batch
        return width <= self.max_width and batch_size <= self.max_verify_batch

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _metadata(
        self, bucket: int, width: int, max_seq_len: int, plan: DecodePlan | None
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.token_inputs[2, : bucket * width],
            query_start_loc=self.query_start_locs[width][: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            block_size=self.block_size,
            max_query_len=width,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(0, bucket * width + 1, width)),
            seq_lens_cpu=[width] * bucket,
            decode_plan=plan,
            tree_bits=self.token_inputs[3, : bucket * width] if width > 1 else None,
        )

    def _forward(self, bucket: int, width: int, plan: DecodePlan,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the last layer's hidden states) of the padded step."""
        num_tokens = bucket * width
        ids, positions = self.token_inputs[0, :num_tokens], self.token_inputs[1, :num_tokens]
        metadata = self._metadata(bucket, width, width, plan)
        hidden = self.model(ids, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden, out), hidden

    def _capture(self, bucket: int, width: int, plan: DecodePlan) -> DecodeGraph:
        # Padding sequences, as replays will see them: no KV write, `width` visible keys.
        num_tokens = bucket * width
        self.token_inputs[:, :num_tokens] = 0
        self.token_inputs[2:, :num_tokens] = -1
        self.seq_lens[:bucket] = width
        start = time.perf_counter()
        # One eager run first: compiles the Triton kernels and settles lazy state
        # (e.g. RoPE tables moved to the device), neither of which may happen in capture.
        vocab_size = self._forward(bucket, width, plan)[0].shape[1]
        if self.logits is None:
            self.logits = torch.empty(self.logits_rows, vocab_size, dtype=torch.float32, device=self.device)
        logits = self.logits[:num_tokens]
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            _, hidden = self._forward(bucket, width, plan, out=logits)
        torch.cuda.synchronize(self.device)
        logger.debug(
            "captured graph: batch %d, %d query tokens each, %s, %.0f ms",
            bucket, width, plan, (time.perf_counter() - start) * 1e3,
        )
        return DecodeGraph(graph, logits, hidden if self.max_width > 1 else None)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture the graphs of steps over short contexts (graphs_at_start); longer contexts'
        split plans are captured on first use."""
        start = time.perf_counter()
        keys = graphs_at_start(self.buckets, self.max_width, self.max_verify_batch, self.num_kv_heads,
                               self.kv_cache_dtype, self.device)
        for key in keys:
            self.graphs[key] = self._capture(*key)
        widths = {width for _, width, _ in self.graphs}
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d), query widths up to %d, %d graphs, in %.1f s",
            len(self.buckets), self.max_batch, max(widths), len(self.graphs), time.perf_counter() - start,
        )

    @torch.inference_mode()
    def run(
        self,
        query_tokens: list[list[int]],
        start_positions: list[int],
        block_tables: list[BlockTable],
        device_token_ids: torch.Tensor | None = None,
        rope_offsets: list[int] | None = None,
        trees: list[tuple[list[int], list[int]] | None] | None = None,
    ) -> torch.Tensor:
        """Logits [sum of query lengths, vocab] fp32 of B sequences: sequence i feeds
        query_tokens[i] (its newest token, then any drafts) from start_positions[i] on;
        its rows are consecutive, in batch order. Valid until the next run.
        `device_token_ids` [B]: one query token per sequence, still on the device (sampled
        by a step the host has not read yet); query_tokens then only give the width.
        `rope_offsets` [B]: added to sequence i's rotary positions only, not to its cache
        slots (M-RoPE: text after an image rotates by its index plus the image's delta).
        `trees` [B]: a token tree's (rotary positions, visibility bits) of each query token
        (query_visibility_bits), or None for a chain."""
        batch = len(query_tokens)
        bucket = self.bucket_for(batch)
        lengths = [len(tokens) for tokens in query_tokens]
        width = max(lengths)
        block_size = self.block_size
        ids, positions, slots, bits = [], [], [], []
        offsets = rope_offsets or [0] * batch
        for tokens, start, table, offset, tree in zip(query_tokens, start_positions, block_tables, offsets,
                                                      trees or [None] * batch):
            pad = width - len(tokens)
            ids += tokens + [0] * pad
            rope = range(start, start + len(tokens)) if tree is None else tree[0]
            # Padding repeats the last position: RoPE tables end at the context limit.
            positions += [p + offset for p in rope] + [rope[-1] + offset] * pad
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(start, start + len(tokens))]
            slots += [-1] * pad
            bits += ([-1] * len(tokens) if tree is None else tree[1]) + [-1] * pad
        num_tokens = bucket * width
        staging, staging_lens = self.stagings[self.num_runs % 2]
        self.num_runs += 1
        staging[:, :num_tokens] = 0
        staging[2:, :num_tokens] = -1
        staging[:, : batch * width] = torch.tensor([ids, positions, slots, bits], dtype=torch.long)
        staging_lens[:bucket] = width
        staging_lens[:batch] = torch.tensor(start_positions, dtype=torch.int32) + width
        self.token_inputs[:, :num_tokens].copy_(staging[:, :num_tokens], non_blocking=True)
        if device_token_ids is not None:
            if width != 1:
                raise ValueError("device token ids are for decode steps (one token each)")
            self.token_inputs[0, :batch].copy_(device_token_ids)
        self.seq_lens[:bucket].copy_(staging_lens[:bucket], non_blocking=True)
        tables = pack_block_tables(block_tables)
        self.block_tables[:batch, : tables.shape[1]].copy_(tables.pin_memory(), non_blocking=True)

        max_seq_len = max(start_positions) + width
        key = (bucket, width, graph_plan(bucket, width, max_seq_len, self.num_kv_heads, self.kv_cache_dtype,
                                         self.device))
        graph = self.graphs.get(key)
        if graph is None:
            # Capturing overwrites the persistent inputs with padding: redo the copies after.
            graph = self.graphs[key] = self._capture(*key)
            return self.run(query_tokens, start_positions, block_tables, device_token_ids, rope_offsets, trees)
        timed = self.replay_events
        if timed is None:
            graph.graph.replay()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.graph.replay()
            end.record()
            timed.append((start, end))
        self.replays[key] += 1
        self.last_key = key
        if all(length == width for length in lengths):
            self._last_rows = slice(0, batch * width)
        else:
            rows = [i * width + j for i, length in enumerate(lengths) for j in range(length)]
            self._last_rows = torch.tensor(rows, device=self.device)
        return graph.logits[self._last_rows]

    def last_hidden(self) -> torch.Tensor:
        """The last run's hidden states of the last layer, [rows of its logits, hidden], in
        the same order; valid until the next run. Kept by engines that speculate only."""
        hidden = self.graphs[self.last_key].hidden
        if hidden is None:
            raise RuntimeError("these CUDA graphs keep no hidden states: the engine does not speculate")
        return hidden[self._last_rows]

    @property
    def num_replays(self) -> int:
        return self.replays.total()

    def served_replay_ms(self) -> list[float]:
        """Device time of each replay timed since replay_events was set to a list, in order:
        the graphs as steps ran them, between the steps' input copies and sampling."""
        events = self.replay_events or []
        if events:
            events[-1][1].synchronize()
        return [start.elapsed_time(end) for start, end in events]

    @torch.inference_mode()
    def replay_last_ms(self, repeats: int = 50) -> float:
        """Device time of the graph the last run replayed, on the same inputs (it rewrites
        the same KV slots with the same values), replayed back to back."""
        return self.replay_ms(self.last_key, repeats)

    @torch.inference_mode()
    def replay_ms(self, key: GraphKey, repeats: int = 50) -> float:
        """replay_last_ms for the graph of `key` (its inputs as the last run of any graph
        left them)."""
        return _replay_time_ms(self.graphs[key].graph, repeats)


def _replay_time_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats
