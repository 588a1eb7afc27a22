"""A smaller model (or a quantized copy of the target) drafts k tokens autoregressively.

It keeps its own paged KV cache: its own ModelRunner (cache tensors) and KVCacheManager
(block tables), fed through the same runner path as the target. Each proposal first
catches the draft cache up on the tokens the target accepted since the last one (and
rolls it back past drafts the target rejected), then runs k one-token steps.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched.output import SchedulerOutput
from kvserve.core.sched.step_builder import StepBuilder
from kvserve.model_executor.loader import LoadedModel, load_model
from kvserve.model_executor.model_runner import ModelRunner
from kvserve.quantization import get_quantization_method, quantize_model
from kvserve.sample.sampler import SamplingRow, final_probs
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.proposer import Draft, DraftContext


def load_draft_model(
    config: SpeculativeConfig, target: LoadedModel, dtype: torch.dtype, device: torch.device
) -> LoadedModel:
    """'same' reuses the target's weights (a quantized deep copy when quantization is set);
    anything else is loaded and must share the target's vocabulary and tokenizer."""
    if config.model == "same":
        if config.quantization is None:
            return target
        model = copy.deepcopy(target.model)
        quantize_model(model, get_quantization_method(config.quantization))
        return LoadedModel(model, target.config, target.tokenizer)
    draft = load_model(config.model, dtype=dtype, device=device, quantization=config.quantization)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_config: model={config.model!r} has a vocabulary of "
            f"{draft.config.vocab_size} tokens; allowed: the target's vocabulary "
            f"({target.config.vocab_size} tokens, same tokenizer)"
        )
    if (
        draft.tokenizer is not None and target.tokenizer is not None
        and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()
    ):
        raise ValueError(
            f"speculative_config: model={config.model!r} has a different tokenizer "
            "(token strings map to other ids); allowed: a draft with the target's tokenizer"
        )
    return draft


@dataclass
class _CacheState:
    num_verified: int = 0  # leading tokens of the sequence whose KV the draft cache holds
    drafts: list[int] = field(default_factory=list)  # drafted tokens cached after them


class DraftModelProposer:
    needs_hidden_states = False

    def __init__(
        self,
        draft: LoadedModel,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        attention_backend: str,
        eos_token_ids: list[int],
        max_batch: int,
    ) -> None:
        """`max_batch`: the most sequences that draft in one step (speculation's
        disable_by_batch_size), the largest batch the draft's decode graphs are captured for."""
        self.model_config = draft.config
        self.runner = ModelRunner(
            draft.model, draft.config, CacheConfig(block_size=block_size, num_blocks=num_blocks),
            SchedulerConfig(max_num_seqs=max_batch), device, attention_backend,
        )
        # No prefix caching: the draft's blocks are private and freed with the sequence.
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.step_builder = StepBuilder(self.kv_cache)
        self.eos_token_ids = eos_token_ids
        self._states: dict[str, _CacheState] = {}

    def retain(self, seq_ids: Iterable[str]) -> None:
        keep = set(seq_ids)
        for seq_id in [s for s in self._states if s not in keep]:
            del self._states[seq_id]
            self.kv_cache.free(seq_id)
            self.step_builder.drop(seq_id)

    def _num_valid(self, seq: DraftContext) -> int:
        """Cached positions that still match the sequence (drafts it accepted count)."""
        state = self._states.setdefault(seq.seq_id, _CacheState())
        valid = state.num_verified
        for draft, actual in zip(state.drafts, seq.all_token_ids[valid:]):
            if draft != actual:
                break
            valid += 1
        return min(valid, seq.num_tokens - 1)  # the last token's logits are needed anew

    @torch.inference_mode()
    def propose(self, seqs: list[DraftContext], num_tokens: list[int]) -> list[Draft]:
        # Per sequence: its tokens with the drafts so far, and how many the cache holds.
        contexts: list[list[int]] = []
        num_cached: list[int] = []
        for seq in seqs:
            valid = self._num_valid(seq)
            if seq.seq_id in self.kv_cache.block_tables:
                self.kv_cache.trim(seq.seq_id, valid)
            # The runner's copy may hold rejected drafts: it gets the sequence whole.
            self.step_builder.resend(seq.seq_id)
            contexts.append(list(seq.all_token_ids))
            num_cached.append(valid)
        drafted: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for step in range(max(num_tokens)):
            active = [i for i in active
                      if num_tokens[i] > step and self._allocate(seqs[i].seq_id, contexts[i], num_cached[i])]
            if not active:
                break
            sched = SchedulerOutput(finished_seq_ids=self.step_builder.take_dropped())
            for i in active:
                self.step_builder.add(sched, seqs[i].seq_id, contexts[i], seqs[i].num_prompt_tokens,
                                      num_cached[i], len(contexts[i]) - num_cached[i])
            logits = self.runner.forward(sched).sample_logits
            tokens, token_probs = self._sample(logits, [seqs[i] for i in active],
                                               [drafted[i] for i in active])
            for row, i in enumerate(active):
                num_cached[i] = len(contexts[i])
                contexts[i].append(tokens[row])
                drafted[i].append(tokens[row])
                if token_probs is not None:
                    probs[i].append(token_probs[row])
        drafts = []
        for seq, context, computed, tokens, rows in zip(seqs, contexts, num_cached, drafted, probs):
            # The cache holds `computed` positions: normally the verified tokens and every
            # draft but the last (fewer if the draft cache ran out).
            self._states[seq.seq_id] = _CacheState(
                min(seq.num_tokens, computed), context[seq.num_tokens : computed]
            )
            greedy = seq.params.is_greedy
            drafts.append(Draft(tokens, None if greedy or not rows else torch.stack(rows)))
        return drafts

    def _allocate(self, seq_id: str, context: list[int], num_cached: int) -> bool:
        return self.kv_cache.allocate_slots(
            seq_id, context, num_cached, len(context) - num_cached
        ) is not None

    def _sample(
        self, logits: torch.Tensor, seqs: list[DraftContext], drafted: list[list[int]]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Drafts follow the request's own sampling transforms (greedy: the argmax), which
        keeps q close to the target's p; the distribution is returned for verification."""
        if all(seq.params.is_greedy for seq in seqs):
            return logits.argmax(dim=-1).tolist(), None
        rows = [
            SamplingRow(seq.params, seq.prompt_token_ids,
                        seq.output_token_ids + tokens, seq.generator, self.eos_token_ids)
            for seq, tokens in zip(seqs, drafted)
        ]
        probs = final_probs(logits, rows)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1).tolist(), probs
