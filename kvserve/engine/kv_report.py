"""The KV cache's state in words a user reads: blocks by state, what sharing saves, what
partly filled blocks waste (internal fragmentation), prefix-cache hits and preemptions.
`/debug/kv`, the Prometheus gauges and `kvserve bench` summaries all read this."""

from __future__ import annotations

from typing import Any

from kvserve.engine.messages import EngineCoreInfo, SchedulerStats


def kv_cache_report(stats: SchedulerStats, info: EngineCoreInfo) -> dict[str, Any]:
    """A JSON-ready summary of the cache as of the engine's last step. Free blocks are
    those neither in use nor cached; PagedAttention wastes only the unused slots of
    sequences' last blocks (and blocks allocated ahead of a step), never whole blocks."""
    block_size, bytes_per_block = info.block_size, info.kv_bytes_per_block
    allocated_slots = stats.kv_blocks_used * block_size
    queries = stats.prefix_cache_queries
    return {
        "block_size": block_size,
        "bytes_per_block": bytes_per_block,
        "blocks": {
            "total": stats.kv_blocks_total,
            "used": stats.kv_blocks_used,
            "cached": stats.kv_blocks_cached,
            "free": stats.kv_blocks_total - stats.kv_blocks_used - stats.kv_blocks_cached,
        },
        "usage": stats.kv_cache_usage,
        "sharing": {
            "shared_blocks": stats.kv_blocks_shared,
            "references_saved": stats.kv_shared_references,
            "bytes_saved": stats.kv_shared_references * bytes_per_block,
        },
        "fragmentation": {
            "allocated_slots": allocated_slots,
            "unused_slots": stats.kv_slots_unused,
            "internal": stats.kv_slots_unused / allocated_slots if allocated_slots else 0.0,
            "unused_bytes": stats.kv_slots_unused * bytes_per_block // block_size,
        },
        "prefix_cache": {
            "queried_tokens": queries,
            "hit_tokens": stats.prefix_cache_hits,
            "hit_rate": stats.prefix_cache_hits / queries if queries else 0.0,
        },
        "preemptions": stats.num_preemptions,
        "sequences": {"running": stats.num_running_seqs, "waiting": stats.num_waiting_seqs},
    }


def summarize_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """What a benchmark run did to the cache, from reports sampled during it (the first
    taken before it): peak blocks used, mean internal fragmentation over the samples with
    blocks in use, peak bytes sharing saved, and the run's preemptions and prefix-cache hit
    rate (the counters' growth between the first and last sample)."""
    first, last = reports[0], reports[-1]
    busy = [r["fragmentation"]["internal"] for r in reports if r["blocks"]["used"]]
    queried = last["prefix_cache"]["queried_tokens"] - first["prefix_cache"]["queried_tokens"]
    hits = last["prefix_cache"]["hit_tokens"] - first["prefix_cache"]["hit_tokens"]
    return {
        "samples": len(reports),
        "peak_blocks_used": max(r["blocks"]["used"] for r in reports),
        "blocks_total": last["blocks"]["total"],
        "peak_usage": max(r["usage"] for r in reports),
        "mean_internal_fragmentation": sum(busy) / len(busy) if busy else 0.0,
        "peak_sharing_bytes_saved": max(r["sharing"]["bytes_saved"] for r in reports),
        "preemptions": last["preemptions"] - first["preemptions"],
        "prefix_cache_hit_rate": hits / queried if queried else 0.0,
    }
