"""Lossless verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

For draft token d drawn from the draft distribution q at a position where the target's
final distribution is p: accept with probability min(1, p(d) / q(d)); on the first
rejection emit a sample of norm(max(0, p - q)) and stop; if all k are accepted emit a
bonus sample of the target's next distribution. Every emitted token is then distributed
exactly as p. Greedy rows have one-hot p, which turns the rule into "accept while the
draft equals the target's argmax, then emit the argmax". An n-gram draft has one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftVerification:
    """One sequence's drafts and what it needs to verify them."""

    draft_token_ids: list[int]
    # [k, V] the distribution each draft was sampled from; None means one-hot (n-gram or
    # greedy drafts).
    draft_probs: torch.Tensor | None
    generator: torch.Generator | None


@dataclass
class VerifiedRun:
    token_ids: list[int]  # the accepted drafts plus one target token
    num_accepted: int  # drafts accepted (len(token_ids) - 1)
    # A token tree's accepted nodes, root to leaf; None: a chain (nodes 0 .. num_accepted - 1).
    accepted_nodes: list[int] | None = None

    @property
    def path(self) -> list[int]:
        return list(range(self.num_accepted)) if self.accepted_nodes is None else self.accepted_nodes

    @property
    def rows(self) -> list[int]:
        """The verify rows whose logits gave each emitted token: the last verified token's
        (row 0), then each accepted node's (row 1 + node)."""
        return [0] + [1 + node for node in self.path]

    @property
    def num_in_place(self) -> int:
        """Accepted drafts whose KV the verify pass wrote where the sequence continues: the
        path's leading nodes 0, 1, 2, ... (all of a chain's); the rest are recomputed."""
        return next((i for i, node in enumerate(self.path) if node != i), self.num_accepted)


def greedy_run(draft_token_ids: list[int], target_token_ids: list[int]) -> VerifiedRun:
    """Greedy verification: drafts are accepted while they equal the target's argmax at
    their position; then the target's own token follows (the rejection rule with a one-hot
    target distribution, whatever the drafts' distribution). target_token_ids: the argmax
    at each draft position and at the bonus position."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    return VerifiedRun(draft_token_ids[:num_accepted] + [target_token_ids[num_accepted]], num_accepted)


def tree_children(parents: list[int]) -> list[list[int]]:
    """Each draft node's children in node order; the root's (parent -1) at index -1."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent].append(node)
    return children


def greedy_tree_run(draft_token_ids: list[int], parents: list[int], target_token_ids: list[int]) -> VerifiedRun:
    """Greedy verification of a token tree: from the root, follow the child whose token is
    the target's argmax at its parent's row while there is one; then the target's token.
    target_token_ids: the argmax at the root's row (0) and each node's (1 + node)."""
    children = tree_children(parents)
    node, path = -1, []
    while True:
        target = target_token_ids[node + 1]
        match = next((child for child in children[node] if draft_token_ids[child] == target), None)
        if match is None:
            return VerifiedRun([draft_token_ids[n] for n in path] + [target], len(path), path)
        path.append(match)
        node = match


def tree_rejection_run(
    target_probs: torch.Tensor, draft_token_ids: list[int], parents: list[int],
    generator: torch.Generator | None,
) -> VerifiedRun:
    """Lossless verification of a token tree whose candidates are deterministic (top-k of a
    draft head: one-hot proposals), by multi-candidate rejection sampling (SpecInfer, EAGLE):
    at a node with target distribution p, each child c in turn is accepted with probability
    p(c); a rejected child's token is removed from p (renormalised: the residual
    max(0, p - onehot(c))); when every child is rejected a token is sampled from what is
    left. Each emitted token is so distributed exactly as p. target_probs: [1 + nodes, V],
    the root's row then each node's."""
    children = tree_children(parents)
    node, path = -1, []
    while True:
        p = target_probs[node + 1].clone()
        accepted = None
        for child in children[node]:
            token = draft_token_ids[child]
            u = torch.rand((), generator=generator, device=p.device)
            if bool(u * p.sum() < p[token]):
                accepted = child
                break
            p[token] = 0.0
        if accepted is None:
            noise = torch.empty_like(p).exponential_(generator=generator).clamp_min_(torch.finfo(p.dtype).tiny)
            token = int(_sample_rows(p[None], noise[None])[0])
            return VerifiedRun([draft_token_ids[n] for n in path] + [token], len(path), path)
        path.append(accepted)
        node = accepted


def accept_mask(
    target_prob_of_draft: torch.Tensor, draft_prob_of_draft: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Accept with probability min(1, p/q): u < p/q, written without dividing by q."""
    return uniform * draft_prob_of_draft < target_prob_of_draft


def _sample_rows(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1) samples probs (unnormalised is fine)."""
    return (probs / noise).argmax(dim=-1)


def rejection_sample(
    target_probs: torch.Tensor, seqs: list[DraftVerification]
) -> list[VerifiedRun]:
    """Verify every sequence's drafts at once.

    target_probs: [sum(k_i + 1), V], per sequence its k_i draft positions then the bonus
    position, in `seqs` order. Seeded sequences draw all their randomness from
    their own generator, so their output does not depend on the rest of the batch.
    """
    device = target_probs.device
    num_drafts = [len(s.draft_token_ids) for s in seqs]
    verify_rows, bonus_rows, offset = [], [], 0
    for k in num_drafts:
        verify_rows.extend(range(offset, offset + k))
        bonus_rows.append(offset + k)
        offset += k + 1
    if offset != target_probs.shape[0]:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, drafts need {offset}")
    drafts = torch.tensor(
        [t for s in seqs for t in s.draft_token_ids], dtype=torch.long, device=device
    )
    verify_index = torch.tensor(verify_rows, dtype=torch.long, device=device)
    p = target_probs[verify_index]
    q = torch.zeros_like(p).scatter_(1, drafts[:, None], 1.0)
    row = 0
    for s, k in zip(seqs, num_drafts):
        if s.draft_probs is not None:
            q[row : row + k] = s.draft_probs[:k]
        row += k
    p_draft = p.gather(1, drafts[:, None]).squeeze(1)
    q_draft = q.gather(1, drafts[:, None]).squeeze(1)

    # Unseeded sequences share one batched draw; seeded ones redraw their own slices:
    # k uniforms, then k + 1 noise rows (k residual samples, one bonus sample).
    uniform = torch.empty(len(verify_rows), device=device).uniform_()
    noise = torch.empty_like(target_probs).exponential_()
    flat_start, row_start = 0, 0
    for s, k in zip(seqs, num_drafts):
        if s.generator is not None:
            uniform[flat_start : flat_start + k].uniform_(generator=s.generator)
            noise[row_start : row_start + k + 1].exponential_(generator=s.generator)
        flat_start += k
        row_start += k + 1
    # Exp(1) == 0 would make 0 / 0 = nan for zero-probability tokens, and argmax picks nan.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    accepted = accept_mask(p_draft, q_draft, uniform)
    bonus_index = torch.tensor(bonus_rows, dtype=torch.long, device=device)
    residual = _sample_rows((p - q).clamp_min_(0.0), noise[verify_index])
    bonus = _sample_rows(target_probs[bonus_index], noise[bonus_index])
    packed = torch.cat([accepted.long(), residual, bonus]).tolist()  # one device -> host copy

    num_verify = len(verify_rows)
    accepted_h = packed[:num_verify]
    residual_h = packed[num_verify : 2 * num_verify]
    bonus_h = packed[2 * num_verify :]
    runs, start = [], 0
    for i, (s, k) in enumerate(zip(seqs, num_drafts)):
        num_accepted = next((j for j in range(k) if not accepted_h[start + j]), k)
        last = residual_h[start + num_accepted] if num_accepted < k else bonus_h[i]
        runs.append(VerifiedRun(s.draft_token_ids[:num_accepted] + [last], num_accepted))
        start += k
    return runs
