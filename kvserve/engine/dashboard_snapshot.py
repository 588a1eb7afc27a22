"""What the live dashboard shows of the engine core at one moment: the KV block map, the
running and waiting queues, the steps since the last snapshot, and the KV report of the
same moment. Plain data, so it crosses from a core in its own process as it is."""

from __future__ import annotations

from typing import Any

from kvserve.core.block_map import build_block_map
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sequence import Sequence
from kvserve.engine.kv_report import kv_cache_report
from kvserve.engine.messages import EngineCoreInfo, SchedulerStats
from kvserve.engine.step_timeline import StepTimeline

MAX_LISTED = 64  # sequences listed per queue (their totals are always sent)


def _sequence_row(seq: Sequence, kv_cache: KVCacheManager) -> dict[str, Any]:
    return {
        "request": seq.request.request_id, "sample": seq.index,
        "prompt_tokens": seq.num_prompt_tokens, "output_tokens": len(seq.output_token_ids),
        "computed_tokens": seq.num_computed_tokens, "blocks": len(kv_cache.block_tables.get(seq.seq_id, ())),
        "preemptions": seq.num_preemptions,
    }


def dashboard_snapshot(scheduler: Scheduler, timeline: StepTimeline, stats: SchedulerStats,
                       info: EngineCoreInfo) -> dict[str, Any]:
    """Also renews the timeline's recording (StepTimeline.watch)."""
    timeline.watch()
    kv_cache = scheduler.kv_cache
    seqs = scheduler.seqs
    block_map = build_block_map(
        kv_cache, lambda seq_id: seqs[seq_id].request.request_id if seq_id in seqs else seq_id)
    return {
        "kv": kv_cache_report(stats, info),
        "block_map": {"owners": block_map.owners, "runs": block_map.runs},
        "running": [_sequence_row(seq, kv_cache) for seq in scheduler.running[:MAX_LISTED]],
        "waiting": [_sequence_row(seq, kv_cache) for seq in scheduler.waiting[:MAX_LISTED]],
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "steps": timeline.take(),
    }
