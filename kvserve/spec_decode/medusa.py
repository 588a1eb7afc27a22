"""Medusa drafting (Cai et al. 2024): extra heads on the target's last hidden state, head i
predicting the token i + 2 places ahead of the row's position, whose top-k candidates form
a static token tree verified in one target pass. No draft model, no draft KV cache.

Checkpoints in the Medusa repository's layout: a directory with `config.json`
(`medusa_num_heads`, `medusa_num_layers`) and `medusa_lm_head.safetensors` (or
`medusa_lm_head.pt`) holding the state dict of its `medusa_head` ModuleList: for head i,
`{i}.{j}.linear.weight` / `.bias` of each residual block j (x + SiLU(W x + b)) and
`{i}.{num_layers}.weight`, the head's own [vocab, hidden] LM head. An optional `draft_vocab`
tensor (kvserve's extension, written by `train-drafter --draft-vocab-size`) lists the target
token of each LM head row: heads over a reduced vocabulary, as EAGLE-3's `d2t`, so drafting
does not project onto the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model_executor.layers.linear import linear
from kvserve.spec_decode.head_checkpoint import read_head_checkpoint
from kvserve.spec_decode.proposer import Draft, DraftContext
from kvserve.spec_decode.tree import TokenTree

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                 draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        # The target token of each LM head row (None: the row's index, the whole vocabulary).
        self.draft_vocab = draft_vocab
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    @property
    def shares_lm_head(self) -> bool:
        return all(head is self.lm_heads[0] for head in self.lm_heads)

    def share_equal_lm_heads(self) -> None:
        """Heads whose LM heads are equal (train-drafter without --train-lm-head: each keeps the
        target's) use one module, so drafting reads the [V, H] matrix once for all heads."""
        first = self.lm_heads[0]
        if all(torch.equal(head.weight, first.weight) for head in self.lm_heads[1:]):
            self.lm_heads = nn.ModuleList(first for _ in self.lm_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_heads, B, V] logits of hidden [B, H]."""
        # kvserve's CPU kernel for few rows has no backward: training (train_drafter) uses torch's.
        matmul = F.linear if torch.is_grad_enabled() else linear
        features = []
        for blocks in self.blocks:
            x = hidden
            for block in blocks:
                x = x + F.silu(matmul(x, block.weight, block.bias))
            features.append(x)
        if self.shares_lm_head:
            # One projection over all heads' rows: on a CPU a few rows cost what one does.
            return matmul(torch.cat(features), self.lm_heads[0].weight).view(self.num_heads, hidden.shape[0], -1)
        return torch.stack([matmul(x, lm_head.weight) for x, lm_head in zip(features, self.lm_heads)])


def load_medusa_heads(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    """The heads at `path`, checked against the target: hidden size and vocabulary."""
    config, state = read_head_checkpoint(
        path, "a Medusa", WEIGHT_FILES,
        "a Medusa checkpoint directory (config.json with medusa_num_heads, medusa_lm_head.*)")
    num_heads = config.get("medusa_num_heads")
    num_layers = config.get("medusa_num_layers", 1)
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"speculative_config: model={path!r}: medusa_num_heads={num_heads!r}; allowed: an integer >= 1")
    head_weight = state.get(f"0.{num_layers}.weight")
    if head_weight is None:
        raise ValueError(f"speculative_config: model={path!r}: no tensor '0.{num_layers}.weight' (the first head's "
                         f"LM head after medusa_num_layers={num_layers} blocks); found {sorted(state)[:6]}")
    vocab_size, hidden_size = head_weight.shape
    draft_vocab = state.pop("draft_vocab", None)
    if draft_vocab is not None:
        if draft_vocab.shape != (vocab_size,) or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= target.vocab_size:
            raise ValueError(f"speculative_config: model={path!r}: draft_vocab has shape {tuple(draft_vocab.shape)} and "
                             f"ids {int(draft_vocab.min())}..{int(draft_vocab.max())}; allowed: one target token id "
                             f"(0..{target.vocab_size - 1}) per LM head row ({vocab_size} rows)")
    elif vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: model={path!r} has a vocabulary of {vocab_size} tokens; allowed: "
                         f"the target's vocabulary ({target.vocab_size} tokens)")
    if hidden_size != target.hidden_size:
        raise ValueError(f"speculative_config: model={path!r} has hidden size {hidden_size}; allowed: the "
                         f"target's hidden size ({target.hidden_size})")
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers,
                        None if draft_vocab is None else draft_vocab.long().to(device))
    ours = {}
    for i in range(num_heads):
        for j in range(num_layers):
            ours[f"blocks.{i}.{j}.weight"] = state.get(f"{i}.{j}.linear.weight")
            ours[f"blocks.{i}.{j}.bias"] = state.get(f"{i}.{j}.linear.bias")
        ours[f"lm_heads.{i}.weight"] = state.get(f"{i}.{num_layers}.weight")
    missing = [name for name, tensor in ours.items() if tensor is None]
    if missing:
        raise ValueError(f"speculative_config: model={path!r} lacks tensors for medusa_num_heads={num_heads}, "
                         f"medusa_num_layers={num_layers}: {missing[:4]}")
    heads.load_state_dict(ours)
    heads.share_equal_lm_heads()
    return heads.to(device=device, dtype=dtype).eval()


class MedusaProposer:
    """Drafts the tree's nodes for each sequence from one pass of the heads over the hidden
    state that predicted its newest token: node (r_1, ..., r_d) is head d's rank-r_d token.
    A sequence allowed fewer drafts takes the tree's first nodes (still a tree)."""

    needs_hidden_states = True

    def __init__(self, heads: MedusaHeads, tree: TokenTree) -> None:
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"speculative_config: the token tree is {tree.max_depth} deep; allowed: at most "
                             f"the checkpoint's {heads.num_heads} Medusa heads")
        self.heads = heads
        self.tree = tree
        self._top_k = max(tree.ranks) + 1
        # A chain (top-1 of each head) is verified as one: plain causal rows, no tree mask.
        self._is_chain = tree.parents == list(range(-1, tree.num_nodes - 1))

    @torch.inference_mode()
    def propose(self, seqs: list[DraftContext], num_tokens: list[int]) -> list[Draft]:
        hidden = torch.stack([seq.hidden_state for seq in seqs]).to(self.heads.lm_heads[0].weight.dtype)
        logits = self.heads(hidden)
        candidates = logits[: self.tree.max_depth].topk(self._top_k, dim=-1).indices
        if self.heads.draft_vocab is not None:
            candidates = self.heads.draft_vocab[candidates]
        candidates = candidates.tolist()  # [depth][B][k]
        drafts = []
        for b, budget in enumerate(num_tokens):
            nodes = range(min(budget, self.tree.num_nodes))
            drafts.append(Draft(
                [candidates[self.tree.depths[n]][b][self.tree.ranks[n]] for n in nodes],
                parents=None if self._is_chain else self.tree.parents[: len(nodes)],
            ))
        return drafts

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Stateless: each proposal reads only the step's hidden states."""
