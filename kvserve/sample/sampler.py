"""Batched token sampling: every request's parameters applied on the logits' device.

Processing order follows vLLM: logit_bias, min_tokens, repetition / frequency /
presence penalties, then greedy argmax or temperature, top-k, top-p, min-p and a
sample. Each optional stage is skipped when no row in the batch uses it, and the
common case copies device -> host exactly once (the sampled ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.ops.argmax import row_argmax
from kvserve.sampling_params import SamplingParams
from kvserve.utils import to_device_async


@dataclass
class SamplingRow:
    """One sequence to sample a token for this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far by this sequence
    generator: torch.Generator | None  # set when params.seed is not None; advanced by sampling
    eos_token_ids: Sequence[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: None unless params.logprobs is set; else {sampled id and top ids: logprob}.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        raw_logits = logits
        token_ids = self.sample_ids(logits, rows)
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not logprob_rows:
            return SamplerOutput(token_ids.tolist(), [None] * len(rows))
        num_tops = [rows[i].params.logprobs for i in logprob_rows]
        ids, row_logprobs = _gather_logprobs(
            raw_logits[logprob_rows], token_ids, logprob_rows, num_tops
        )
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        for i, entry in zip(logprob_rows, row_logprobs):
            logprobs[i] = entry
        return SamplerOutput(ids, logprobs)

    @staticmethod
    def sample_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The sampled ids [S], left on the logits' device; on a GPU nothing here waits for
        the device, so the host can go on while the step runs (overlapped scheduling)."""
        return _sample(_apply_request_transforms(logits, rows), rows)


def final_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row samples from after every transform, normalised [S, V]:
    one-hot at the argmax for greedy rows. Speculative verification accepts and resamples
    against exactly this, so it stays lossless."""
    logits = _apply_request_transforms(logits, rows)
    greedy = torch.tensor([row.params.is_greedy for row in rows], device=logits.device)
    temperature = torch.tensor(
        [1.0 if row.params.is_greedy else row.params.temperature for row in rows],
        dtype=logits.dtype, device=logits.device,
    ).unsqueeze(1)
    probs = _apply_min_p(_apply_top_k_top_p(torch.softmax(logits / temperature, dim=-1), rows), rows)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def gather_logprobs(
    raw_logits: torch.Tensor, token_ids: list[int], num_tops: list[int]
) -> list[dict[int, float]]:
    """Per row: {chosen id and top-num_tops ids: logprob} from raw logits, as the sampler
    reports them (for tokens chosen elsewhere, e.g. accepted drafts)."""
    chosen = torch.tensor(token_ids, dtype=torch.long, device=raw_logits.device)
    _, entries = _gather_logprobs(raw_logits, chosen, list(range(len(token_ids))), num_tops)
    return entries


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: Sequence[int], num_top: int
) -> list[dict[int, float]]:
    """Logprob of each actual next prompt token (row i predicts target_ids[i]) plus the
    top-``num_top`` alternatives, from the raw logits [P, V]."""
    if len(target_ids) != logits.shape[0]:
        raise ValueError(f"{len(target_ids)} target ids for {logits.shape[0]} logit rows")
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    all_rows = list(range(len(target_ids)))
    _, entries = _gather_logprobs(logits, targets, all_rows, [num_top] * len(all_rows))
    return entries


def _gather_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    rows: list[int],
    num_tops: list[int],
) -> tuple[list[int], list[dict[int, float]]]:
    """log_softmax(logits) at token_ids[rows] and each row's top-num_tops ids.

    Returns all of token_ids on the host plus one dict per entry of ``rows``; the
    ids and logprobs travel packed in one float64 tensor (exact for ids < 2**53)
    so this stays a single device -> host copy.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    chosen = token_ids[index]
    chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1)
    max_top = min(max(num_tops), logprobs.shape[1])
    top_logprobs, top_ids = logprobs.topk(max_top, dim=-1)
    packed = torch.cat([
        token_ids.double(), chosen_logprobs.double(),
        top_ids.double().flatten(), top_logprobs.double().flatten(),
    ]).tolist()

    num_ids, num_rows = token_ids.shape[0], len(rows)
    host_ids = [int(t) for t in packed[:num_ids]]
    chosen_lp = packed[num_ids:num_ids + num_rows]
    tops_start = num_ids + num_rows
    vals_start = tops_start + num_rows * max_top
    entries = []
    for j, (row, num_top) in enumerate(zip(rows, num_tops)):
        base = j * max_top
        entry = {
            int(packed[tops_start + base + k]): packed[vals_start + base + k]
            for k in range(min(num_top, max_top))
        }
        entry[host_ids[row]] = chosen_lp[j]
        entries.append(entry)
    return host_ids, entries


def _apply_request_transforms(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias, min_tokens and the penalties: what comes before temperature."""
    logits = _apply_logit_bias(logits, rows)
    logits = _apply_min_tokens(logits, rows)
    return _apply_penalties(logits, rows)


def _row_values(rows: list[SamplingRow], attr: str, device: torch.device) -> torch.Tensor:
    """Column [S, 1] of one float parameter across rows."""
    values = [float(getattr(row.params, attr)) for row in rows]
    return to_device_async(values, torch.float32, device).unsqueeze(1)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for tok, bias in (row.params.logit_bias or {}).items():
            row_idx.append(i)
            tok_idx.append(tok)
            biases.append(bias)
    if not row_idx:
        return logits
    device = logits.device
    return logits.index_put(
        (to_device_async(row_idx, torch.long, device), to_device_async(tok_idx, torch.long, device)),
        to_device_async(biases, logits.dtype, device),
        accumulate=True,
    )


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Forbid ending (EOS unless ignore_eos, and stop_token_ids) before min_tokens."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens:
            continue
        banned = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            banned += list(row.eos_token_ids)
        row_idx += [i] * len(banned)
        tok_idx += banned
    if not row_idx:
        return logits
    device = logits.device
    return logits.index_put(
        (torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)),
        torch.tensor(float("-inf"), dtype=logits.dtype, device=device),
    )


def _token_index(
    rows: list[SamplingRow], selected: list[int], with_prompt: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs, one per token occurrence in the selected rows."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i in selected:
        tokens = list(rows[i].output_token_ids)
        if with_prompt:
            tokens += list(rows[i].prompt_token_ids)
        row_idx += [i] * len(tokens)
        tok_idx += tokens
    return (torch.tensor(row_idx, dtype=torch.long, device=device),
            torch.tensor(tok_idx, dtype=torch.long, device=device))


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    repetition_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if repetition_rows:
        # HF semantics over prompt + output: shrink the logit of every seen token
        # towards "less likely" (divide if positive, multiply if negative).
        index = _token_index(rows, repetition_rows, with_prompt=True, device=device)
        seen = torch.zeros_like(logits, dtype=torch.bool).index_put_(
            index, torch.tensor(True, device=device))
        penalty = _row_values(rows, "repetition_penalty", device)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)

    additive_rows = [
        i for i, r in enumerate(rows)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if additive_rows:
        # OpenAI semantics over output tokens only.
        index = _token_index(rows, additive_rows, with_prompt=False, device=device)
        counts = torch.zeros_like(logits).index_put_(
            index, torch.tensor(1.0, dtype=logits.dtype, device=device), accumulate=True)
        frequency = _row_values(rows, "frequency_penalty", device)
        presence = _row_values(rows, "presence_penalty", device)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    greedy = [row.params.is_greedy for row in rows]
    if all(greedy):
        return row_argmax(logits)
    device = logits.device
    if any(not g and row.params.temperature != 1.0 for g, row in zip(greedy, rows)):
        # Greedy rows divide by 1: their sample is discarded for the argmax below.
        temperature = to_device_async(
            [1.0 if g else row.params.temperature for g, row in zip(greedy, rows)],
            logits.dtype, device,
        ).unsqueeze(1)
        probs = torch.softmax(logits / temperature, dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1)
    probs = _apply_top_k_top_p(probs, rows)
    probs = _apply_min_p(probs, rows)
    # Filtered probs are not renormalised: argmax(probs / q) is scale invariant.
    sampled = row_argmax(probs.div_(_exponential_noise(probs, rows, greedy)))
    if any(greedy):
        is_greedy = to_device_async(greedy, torch.bool, device)
        sampled = torch.where(is_greedy, row_argmax(logits), sampled)
    return sampled


def _apply_top_k_top_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab_size = probs.shape[1]
    use_top_k = any(0 < row.params.top_k < vocab_size for row in rows)
    use_top_p = any(row.params.top_p < 1.0 for row in rows)
    if not use_top_k and not use_top_p:
        return probs
    device = probs.device
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if use_top_k:
        top_k = to_device_async(
            [row.params.top_k if row.params.top_k > 0 else vocab_size for row in rows],
            torch.long, device,
        ).unsqueeze(1)
        rank = torch.arange(vocab_size, device=device).unsqueeze(0)
        sorted_probs = sorted_probs.masked_fill(rank >= top_k, 0.0)
    if use_top_p:
        # Top-p applies to the top-k-renormalised distribution: keep a token while the
        # mass strictly before it is < top_p, i.e. the smallest set reaching top_p.
        # The first token has zero mass before it, so it is always kept.
        renormed = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = renormed.cumsum(dim=-1) - renormed
        top_p = _row_values(rows, "top_p", device).to(probs.dtype)
        drop = (mass_before >= top_p) & (top_p < 1.0)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _apply_min_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    if not any(row.params.min_p > 0.0 for row in rows):
        return probs
    min_p = _row_values(rows, "min_p", probs.device).to(probs.dtype)
    # Relative to the max, so filtering/rescaling done earlier does not change it.
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_noise(
    probs: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
) -> torch.Tensor:
    """q ~ Exp(1) per token; argmax(probs / q) is then a sample from probs.

    Seeded rows draw from their own generator so their tokens do not depend on the
    rest of the batch; everyone else shares one batched draw.
    """
    noise = torch.empty_like(probs).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None and not greedy[i]:
            noise[i].exponential_(generator=row.generator)
    # q == 0 would give 0/0 = nan for filtered tokens, and argmax picks nan.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
