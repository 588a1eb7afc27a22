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
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.model_executor.loader import LoadedModel, load_model
from kvserve.model_executor.model_runner import ModelRunner
from kvserve.quantization import get_quantization_method, quantize_model
from kvserve.sample.sampler import SamplingRow, final_probs
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.proposer import Draft


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


class _DraftView:
    """The part of a Sequence that ModelRunner.execute reads, for the draft's own pass."""

    index = 0
    wants_prompt_logprobs = False
    spec_token_ids: list[int] = []
    spec_tree_parents = None

    def __init__(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        self.seq_id = seq_id
        self.all_token_ids = token_ids
        self.num_computed_tokens = num_computed
        self.num_prompt_tokens = len(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _CacheState:
    num_verified: int = 0  # leading tokens of the sequence whose KV the draft cache holds
    drafts: list[int] = field(default_factory=list)  # drafted tokens cached after them


class DraftModelProposer:
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
        self.eos_token_ids = eos_token_ids
        self._states: dict[str, _CacheState] = {}

    def retain(self, seq_ids: Iterable[str]) -> None:
        keep = set(seq_ids)
        for seq_id in [s for s in self._states if s not in keep]:
            del self._states[seq_id]
            self.kv_cache.free(seq_id)

    def _num_valid(self, seq: Sequence) -> int:
        """Cached positions that still match the sequence (drafts it accepted count)."""
        state = self._states.setdefault(seq.seq_id, _CacheState())
        valid = state.num_verified
        for draft, actual in zip(state.drafts, seq.all_token_ids[valid:]):
            if draft != actual:
                break
            valid += 1
        return min(valid, seq.num_tokens - 1)  # the last token's logits are needed anew

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        views = []
        for seq in seqs:
            valid = self._num_valid(seq)
            if seq.seq_id in self.kv_cache.block_tables:
                self.kv_cache.trim(seq.seq_id, valid)
            views.append(_DraftView(seq.seq_id, list(seq.all_token_ids), valid))
        drafted: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for step in range(max(num_tokens)):
            active = [i for i in active if num_tokens[i] > step and self._allocate(views[i])]
            if not active:
                break
            sched = SchedulerOutput(
                scheduled_seqs=[views[i] for i in active],
                num_scheduled_tokens={
                    views[i].seq_id: views[i].num_tokens - views[i].num_computed_tokens
                    for i in active
                },
            )
            tables = {views[i].seq_id: self.kv_cache.block_ids(views[i].seq_id) for i in active}
            logits = self.runner.execute(sched, tables).sample_logits
            tokens, token_probs = self._sample(logits, [seqs[i] for i in active],
                                               [drafted[i] for i in active])
            for row, i in enumerate(active):
                view = views[i]
                view.num_computed_tokens = view.num_tokens
                view.all_token_ids.append(tokens[row])
                drafted[i].append(tokens[row])
                if token_probs is not None:
                    probs[i].append(token_probs[row])
        drafts = []
        for seq, view, tokens, rows in zip(seqs, views, drafted, probs):
            # The cache holds view.num_computed_tokens positions: normally the verified
            # tokens and every draft but the last (fewer if the draft cache ran out).
            computed = view.num_computed_tokens
            self._states[seq.seq_id] = _CacheState(
                min(seq.num_tokens, computed), view.all_token_ids[seq.num_tokens : computed]
            )
            greedy = seq.request.params.is_greedy
            drafts.append(Draft(tokens, None if greedy or not rows else torch.stack(rows)))
        return drafts

    def _allocate(self, view: _DraftView) -> bool:
        num_new = view.num_tokens - view.num_computed_tokens
        return self.kv_cache.allocate_slots(
            view.seq_id, view.all_token_ids, view.num_computed_tokens, num_new
        ) is not None

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Drafts follow the request's own sampling transforms (greedy: the argmax), which
        keeps q close to the target's p; the distribution is returned for verification."""
        if all(seq.request.params.is_greedy for seq in seqs):
            return logits.argmax(dim=-1).tolist(), None
        rows = [
            SamplingRow(seq.request.params, seq.prompt_token_ids,
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
