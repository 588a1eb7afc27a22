"""Writes SchedulerOutputs for one model runner, remembering what that runner holds."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.multimodal.inputs import ImageFeature
from kvserve.core.sched.output import CachedSequenceData, NewSequenceData, SchedulerOutput
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams


class StepBuilder:
    """Tracks which sequences a runner holds and how many of each one's tokens, so that a
    step sends a sequence whole once and then only its new tokens and block-table changes
    (which `kv_cache` tracks)."""

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        self._num_tokens_held: dict[str, int] = {}
        self._dropped: list[str] = []

    def add(
        self,
        out: SchedulerOutput,
        seq_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        wants_prompt_logprobs: bool = False,
        params: SamplingParams | None = None,
        sample_index: int = 0,
        max_tokens: int = 0,
        mm_features: Sequence[ImageFeature] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Schedule `num_new_tokens` of the sequence, after its computed ones, in `out`
        (`params` etc.: how the runner samples it, see NewSequenceData)."""
        num_held = self._num_tokens_held.get(seq_id)
        self._num_tokens_held[seq_id] = len(token_ids)
        if num_held is None:
            _, block_ids = self.kv_cache.take_block_delta(seq_id, whole=True)
            out.new_seqs.append(NewSequenceData(
                seq_id, list(token_ids), num_prompt_tokens, num_computed_tokens, block_ids,
                wants_prompt_logprobs, params, sample_index, max_tokens, list(mm_features), lora_request,
            ))
        else:
            num_kept, new_block_ids = self.kv_cache.take_block_delta(seq_id)
            out.cached_seqs.append(CachedSequenceData(
                seq_id, list(token_ids[num_held:]), num_computed_tokens, num_kept, new_block_ids,
            ))
        out.num_scheduled_tokens[seq_id] = num_new_tokens

    def resend(self, seq_id: str) -> None:
        """The next step sends the sequence whole, replacing what the runner holds."""
        self._num_tokens_held.pop(seq_id, None)

    def drop(self, seq_id: str) -> None:
        """The runner forgets the sequence before the next step (finished, aborted)."""
        if self._num_tokens_held.pop(seq_id, None) is not None:
            self._dropped.append(seq_id)

    def take_dropped(self) -> list[str]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def put_back_dropped(self, seq_ids: list[str]) -> None:
        """Dropped sequences a step that never ran had taken: the next step carries them."""
        self._dropped = seq_ids + self._dropped
