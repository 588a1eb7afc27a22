"""Overlapped scheduling: launch decode step N+1 before the host has read step N's tokens.

A decode step's inputs are the previous step's sampled ids, which are already on the
device; only the host's bookkeeping (appending tokens, detokenizing, stop checks, building
outputs) needs them on the host. So the engine launches step N+1 with step N's ids as its
inputs, then reads N's ids and does N's bookkeeping while the GPU runs N+1. A sequence
that step N ends (EOS, a stop string) was computed once more by N+1 for nothing; that
token is dropped. A sequence that N certainly ends (its length limit) is left out of N+1.

Only steps whose sampling reads nothing of the host's lagging state run ahead (see
`can_sample_ahead`); every other step, and every step with speculative decoding, runs one
at a time. The runner keeps the launched steps (ModelRunner.launch / collect); the core
decides which steps may go ahead (EngineCore.step).
"""

from __future__ import annotations

from kvserve.core.sequence import Sequence


def can_sample_ahead(seq: Sequence) -> bool:
    """Whether the sequence is decoding and its next token can be sampled before the host
    holds its previous one: no logprobs to gather, and no penalty or min_tokens ban that
    depends on the output so far. A grammar's mask needs the previous token on the host:
    the runner reads it after launching the step's forward, before its sampling."""
    params = seq.request.params
    return (
        bool(seq.output_token_ids)  # past its prompt (and past the fork of n > 1 samples)
        and not seq.spec_token_ids
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and len(seq.output_token_ids) >= params.min_tokens
    )
