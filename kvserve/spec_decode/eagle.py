"""EAGLE-1 drafting (Li et al. 2024): a one-decoder-layer network that extrapolates the
target's last-layer features. The pair at position t fuses the feature f_t (the target's
hidden state at t) with the embedding of token t + 1 through `fc`, runs one Llama decoder
layer (no input norm) over the pairs so far, and its output estimates f_{t+1}, which the
target's LM head turns into the next draft token; drafting k tokens chains k such steps.

Checkpoints in the EAGLE repository's layout (also what vLLM and SGLang load): a directory
with a Llama `config.json` and `pytorch_model.bin` or `model.safetensors` holding `fc.weight`
[H, 2H] (and `fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight` and `layers.0.post_attention_layernorm.weight`
(an optional `model.` prefix and `embed_tokens.weight` are accepted; the target's embedding
is used). An optional `d2t` [N] (EAGLE-3's mapping: target id = draft id + d2t[draft id])
restricts drafting to those N rows of the target's LM head: a fraction of the cost of the
full head for each drafted token, the lever on a small model whose LM head is a large share
of a step.

The draft layer's keys and values of each sequence's pairs (one layer: a few KB a token)
live in the drafter's own paged cache (PagedDraftCache: blocks of the engine's block size,
as many as the target's cache has); each sequence also keeps the target's features not
consumed yet. Drafted pairs past the verified tokens are dropped after each proposal, so
the next one continues from verified pairs only. A sequence that finds no free block skips
drafting that step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model_executor.layers.linear import linear
from kvserve.spec_decode.head_checkpoint import read_head_checkpoint
from kvserve.spec_decode.paged_draft_cache import DraftRows, PagedDraftCache, paged_cache_bytes_per_block
from kvserve.spec_decode.proposer import Draft, DraftContext
from kvserve.spec_decode.tree import TokenTree

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER = "layers.0."


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated), x [T, heads, D], cos/sin [T, D]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-second, first], dim=-1) * sin[:, None]


class EagleHead(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                 rope_theta: float, rms_norm_eps: float, fc_bias: bool) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.rope_theta, self.eps = rope_theta, rms_norm_eps
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=fc_bias)
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden_size))
        # Target token ids of the draft vocabulary (sorted), or None: the whole vocabulary.
        self.draft_vocab: torch.Tensor | None = None

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: EagleCache | DraftRows) -> torch.Tensor:
        """Estimated next features [m, H] of m pairs (embedding of token t + 1, feature f_t)
        at positions t; their keys/values are appended to `cache` (DraftRows: several
        sequences' pairs in a paged cache, batched)."""
        x = _matmul()(torch.cat([embeds, features], dim=-1), self.fc.weight, self.fc.bias)
        return draft_layer(self, x, x, positions, cache)

    def forward_sequence(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Estimated next features [n, H] of a whole sequence's n pairs in one causal pass, no
        draft cache kept: training's forward (differentiable where grad is enabled)."""
        return self(embeds, features, torch.arange(embeds.shape[0], device=embeds.device), EagleCache())


def _matmul() -> Callable[..., torch.Tensor]:
    # kvserve's CPU kernel for few rows has no backward: training (train_eagle) uses torch's.
    return F.linear if torch.is_grad_enabled() else linear


def draft_layer(head: nn.Module, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                cache: EagleCache | DraftRows, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The draft decoder layer of an EAGLE head (its q/k/v/o projections, post-attention
    norm and gated MLP): causal attention of x's m rows over the cached ones (their keys
    and values appended to `cache`) added to `residual`, then the MLP's residual add.
    With DraftRows, x holds several sequences' rows one after another: the projections
    run on all of them at once, each sequence's rows attend its own cached positions.
    `mask` ([m, cached + m], True where a row attends; an EagleCache only) replaces the
    causal one (training's unrolled draft steps attend their own chain only)."""
    m = x.shape[0]
    matmul = _matmul()
    exponents = torch.arange(0, head.head_dim, 2, dtype=torch.float32, device=x.device) / head.head_dim
    angles = positions.to(x.device).float()[:, None] * (1.0 / head.rope_theta**exponents)[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q = _rotate(matmul(x, head.q_proj.weight).view(m, head.num_heads, head.head_dim), cos, sin)
    k = _rotate(matmul(x, head.k_proj.weight).view(m, head.num_kv_heads, head.head_dim), cos, sin)
    v = matmul(x, head.v_proj.weight).view(m, head.num_kv_heads, head.head_dim)
    if isinstance(cache, EagleCache):
        attended = _attend(q, k, v, cache, mask)
    elif mask is None:
        attended = cache.attend(q, k, v)
    else:
        raise ValueError("draft_layer: a custom mask needs an EagleCache (a paged cache attends causally)")
    hidden = residual + matmul(attended, head.o_proj.weight)
    h = _rms_norm(hidden, head.post_attention_layernorm, head.eps)
    return hidden + matmul(F.silu(matmul(h, head.gate_proj.weight)) * matmul(h, head.up_proj.weight),
                           head.down_proj.weight)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: EagleCache,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's m query rows over its cache with k, v appended: [m, heads x dim]."""
    m = q.shape[0]
    keys, values = cache.append(k, v)
    length = keys.shape[0]
    if mask is None:
        arange = torch.arange(length, device=q.device)
        mask = arange[None, :] <= arange[length - m :, None]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, enable_gqa=True)[0].transpose(0, 1).reshape(m, -1)


class EagleCache:
    """One sequence's draft-layer keys and values, [length, kv_heads, head_dim] each, held
    whole and grown by concatenation (differentiable): training's cache. Given tensors are
    never written."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        self.keys, self.values = keys, values

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k])
        self.values = v if self.values is None else torch.cat([self.values, v])
        return self.keys, self.values


@dataclass
class LoadedEagleHead:
    """An EAGLE-1 or EAGLE-3 head, loaded before the target's KV cache is sized (its weights
    and its paged cache's blocks count against the memory budget)."""

    head: nn.Module
    # EAGLE-3: the target layers whose entering residual streams the head reads.
    aux_layers: tuple[int, ...] = ()


def draft_cache_bytes_per_block(head: nn.Module, block_size: int) -> int:
    """What a block of an EAGLE head's paged cache takes: its one layer's keys and values."""
    return paged_cache_bytes_per_block(block_size, head.num_kv_heads, head.head_dim, head.fc.weight.dtype)


def paged_draft_cache(head: nn.Module, num_blocks: int, block_size: int, attention_backend: str = "auto"
                      ) -> PagedDraftCache:
    """A paged cache for an EAGLE head's layer, in its dtype and on its device."""
    weight = head.fc.weight
    return PagedDraftCache(num_blocks, block_size, head.num_kv_heads, head.head_dim, weight.dtype, weight.device,
                           attention_backend)


def read_eagle_checkpoint(path: str, described: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-1 and EAGLE-3 checkpoints: the EAGLE repository's and vLLM/SGLang's layouts."""
    return read_head_checkpoint(path, "an EAGLE", WEIGHT_FILES, described, strip_prefix="model.")


def load_eagle_head(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The EAGLE-1 head at `path`, checked against the target: hidden size, vocabulary."""
    config, state = read_eagle_checkpoint(
        path, "an EAGLE checkpoint directory (a Llama config.json and the head's weights)")
    fc = state.get("fc.weight")
    if fc is None:
        raise ValueError(f"speculative_config: model={path!r} has no 'fc.weight' (EAGLE's fusion of embeddings "
                         f"and features); found {sorted(state)[:6]}")
    hidden_size = fc.shape[0]
    if hidden_size != target.hidden_size or fc.shape[1] != 2 * hidden_size:
        raise ValueError(f"speculative_config: model={path!r} fuses [{fc.shape[1]}] inputs into hidden size "
                         f"{hidden_size}; allowed: the target's hidden size {target.hidden_size} "
                         f"(fc.weight [{target.hidden_size}, {2 * target.hidden_size}])")
    vocab = config.get("vocab_size")
    embed = state.get("embed_tokens.weight")
    if embed is not None:
        vocab = embed.shape[0]
    if vocab is not None and vocab != target.vocab_size:
        raise ValueError(f"speculative_config: model={path!r} has a vocabulary of {vocab} tokens; allowed: the "
                         f"target's vocabulary ({target.vocab_size} tokens)")
    num_heads = config.get("num_attention_heads", target.num_attention_heads)
    head = EagleHead(
        hidden_size, num_heads, config.get("num_key_value_heads", num_heads),
        config.get("intermediate_size", state[f"{_LAYER}mlp.gate_proj.weight"].shape[0]
                   if f"{_LAYER}mlp.gate_proj.weight" in state else 4 * hidden_size),
        config.get("rope_theta", 10000.0), config.get("rms_norm_eps", 1e-6), "fc.bias" in state)
    names = {"fc.weight": "fc.weight", "fc.bias": "fc.bias",
             "post_attention_layernorm": f"{_LAYER}post_attention_layernorm.weight"}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"{proj}.weight"] = f"{_LAYER}self_attn.{proj}.weight"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"{proj}.weight"] = f"{_LAYER}mlp.{proj}.weight"
    ours = {name: state.get(theirs) for name, theirs in names.items() if name != "fc.bias" or head.fc.bias is not None}
    missing = [names[name] for name, tensor in ours.items() if tensor is None]
    if missing:
        raise ValueError(f"speculative_config: model={path!r} lacks {missing[:4]} (EAGLE-1's one decoder layer)")
    try:
        head.load_state_dict(ours)
    except RuntimeError as error:
        raise ValueError(f"speculative_config: model={path!r}: its tensors do not fit its config.json: {error}") from None
    if state.get("d2t") is not None:
        head.draft_vocab = draft_vocab_of(state["d2t"], state["d2t"].shape[0], path, target).to(device)
    return head.to(device=device, dtype=dtype).eval()


def draft_vocab_of(d2t: torch.Tensor, draft_vocab_size: int, path: str, target: ModelConfig) -> torch.Tensor:
    """The target ids of a draft vocabulary from EAGLE-3's d2t (target id = draft id +
    d2t[draft id]); a clear error where they fall outside the target's vocabulary."""
    mapped = torch.arange(draft_vocab_size) + d2t.long()
    if d2t.shape != (draft_vocab_size,) or int(mapped.min()) < 0 or int(mapped.max()) >= target.vocab_size:
        raise ValueError(f"speculative_config: model={path!r}: d2t maps its {draft_vocab_size} draft tokens to ids in "
                         f"[{int(mapped.min())}, {int(mapped.max())}]; allowed: the target's vocabulary "
                         f"[0, {target.vocab_size})")
    return mapped


# A drafter's candidates: (estimated features [m, H], n) -> the top n target token ids of
# each row, best first, [m, n].
TopTokens = Callable[[torch.Tensor, int], torch.Tensor]


def top_ids(logits: torch.Tensor, n: int) -> torch.Tensor:
    """The n best columns of each row, best first (n = 1: the argmax, ties to the lower id)."""
    return logits.argmax(dim=-1, keepdim=True) if n == 1 else logits.topk(n, dim=-1).indices


def target_lm_head_drafter(head: EagleHead, lm_head_weight: torch.Tensor | None,
                           full_vocab: Callable[[torch.Tensor], torch.Tensor]) -> TopTokens:
    """EAGLE-1's draft candidates of each estimated feature: the best of the target's LM head
    (`full_vocab`: the target's logits) or, with a draft vocabulary, of its rows of
    `lm_head_weight` [V, H] (None, a sharded head: of full_vocab's columns), mapped back to
    target ids."""
    if head.draft_vocab is None:
        return lambda estimate, n: top_ids(full_vocab(estimate), n)
    vocab = head.draft_vocab
    if lm_head_weight is None:
        return lambda estimate, n: vocab[top_ids(full_vocab(estimate)[:, vocab], n)]
    rows = lm_head_weight.detach()[vocab].contiguous()
    return lambda estimate, n: vocab[top_ids(linear(estimate.to(rows.dtype), rows), n)]


def check_eagle_tree(tree: TokenTree) -> None:
    """EAGLE drafts one chain of features: only the top-1 chain's nodes can have children
    (the other candidates at each depth are leaves)."""
    for path in tree.paths:
        if any(rank != 0 for rank in path[:-1]):
            raise ValueError(f"speculative_token_tree: node {path!r} descends from a candidate that is not the "
                             f"top one; EAGLE extends the top-1 chain only: paths like (0, 0, r)")


@dataclass
class _SequenceState:
    # The first paired position: a prompt's prefix-cache hit is never recomputed, so its
    # features never come; the pairs start at the first computed position.
    start: int = 0
    # Target features of positions start + the cached pairs, ... not paired yet.
    features: list[torch.Tensor] = field(default_factory=list)


class EagleProposer:
    """EAGLE-1 and EAGLE-3 drafting, one sequence at a time: catch the sequence's pairs up on
    the target features its steps produced, then extrapolate features along the top-1 chain
    and take the LM head's best candidates of each (one-hot drafts: lossless with any
    sampling parameters): the chain of argmaxes, or with a token tree the top candidates at
    each depth as siblings (more chances that one is accepted, for no more head steps)."""

    needs_hidden_states = True
    reads_step_features = True

    def __init__(self, head: nn.Module, embed_tokens: nn.Embedding, top_tokens: TopTokens, cache: PagedDraftCache,
                 tree: TokenTree | None = None) -> None:
        """`head`: EAGLE-1's or EAGLE-3's; `top_tokens`: the draft candidates of each
        estimated feature (EAGLE-1: the target LM head's best; EAGLE-3: the head's own);
        `cache`: the head layer's paged cache (paged_draft_cache); `tree`: whose non-top-1
        nodes are leaves (check_eagle_tree); None: a chain."""
        self.head = head
        self.embed_tokens = embed_tokens
        self.top_tokens = top_tokens
        self.cache = cache
        if tree is not None:
            check_eagle_tree(tree)
        self.tree = tree
        self._states: dict[str, _SequenceState] = {}

    def observe(self, seq_id: str, first_position: int, features: torch.Tensor) -> None:
        """Target features [m, H] of positions first_position.. (a step's verified rows).
        After a gap (steps whose features were not handed over: speculation was off for
        their batch size) the sequence's pairs start again at first_position, as after a
        prefix-cache hit."""
        state = self._states.get(seq_id)
        if (state is None or first_position < state.start
                or first_position > self._next_pair(seq_id) + len(state.features)):
            state = self._states[seq_id] = _SequenceState(start=first_position)
            self.cache.truncate(seq_id, 0)
        expected = self._next_pair(seq_id) + len(state.features)
        if first_position < expected:
            # Positions seen already: a tree path through a lower-ranked branch has its KV
            # recomputed in the next step. Verified tokens never change, nor their features.
            features = features[expected - first_position :]
            first_position = expected
        if first_position == expected:
            state.features.extend(features.unbind(0))

    @torch.inference_mode()
    def propose(self, seqs: list[DraftContext], num_tokens: list[int]) -> list[Draft]:
        """All sequences' drafts in one batch: a head call for every sequence's catch-up pairs,
        then one a depth for all of them (each sequence's rows attend its own cache)."""
        drafts = [Draft([]) for _ in seqs]
        batch = self._batch(seqs, num_tokens)
        if not batch:
            return drafts
        dtype, device = self.head.fc.weight.dtype, self.head.fc.weight.device
        seq_ids = [seqs[index].seq_id for index, _, _ in batch]
        embeds, features, positions, counts = [], [], [], []
        for index, state, _ in batch:
            tokens = seqs[index].all_token_ids
            # Pairs (f_t, token t + 1) for every t from the cache's end up to the newest
            # token's predecessor.
            start, count = self._next_pair(seqs[index].seq_id), self._num_new_pairs(seqs[index])
            features.append(torch.stack(state.features[:count]))
            del state.features[:count]
            embeds.append(torch.tensor(tokens[start + 1 :], device=device))
            positions.append(torch.arange(start, start + count, device=device))
            counts.append(count)
        outputs = self.head(self.embed_tokens(torch.cat(embeds)).to(dtype), torch.cat(features).to(dtype),
                            torch.cat(positions), self.cache.extend(seq_ids, counts))
        verified = [self.cache.length(seq_id) for seq_id in seq_ids]  # the draft steps' keys are dropped after
        estimates = outputs[torch.tensor(list(itertools.accumulate(counts)), device=device) - 1]
        # Candidates wanted at each depth, per sequence (the most any sequence wants).
        wanted = [[0] * max(len(path) for path in paths) for _, _, paths in batch]
        for rows, (_, _, paths) in zip(wanted, batch):
            for path in paths:
                rows[len(path) - 1] = max(rows[len(path) - 1], path[-1] + 1)
        depth_count = max(len(rows) for rows in wanted)
        candidates = []  # per depth: [batch, n] target ids
        for depth in range(depth_count):
            n = max(rows[depth] if depth < len(rows) else 1 for rows in wanted)
            candidates.append(self.top_tokens(estimates, n).tolist())
            if depth + 1 < depth_count:  # one more head step, every sequence along its top-1 chain
                tokens = torch.tensor([row[0] for row in candidates[-1]], device=device)
                step_positions = torch.tensor([state.start + length + depth
                                               for (_, state, _), length in zip(batch, verified)])
                estimates = self.head(self.embed_tokens(tokens).to(dtype), estimates, step_positions,
                                      self.cache.extend(seq_ids, [1] * len(batch)))
        for row, ((index, _, paths), seq_id, length) in enumerate(zip(batch, seq_ids, verified)):
            self.cache.truncate(seq_id, length)
            drafts[index] = Draft([candidates[len(path) - 1][row][path[-1]] for path in paths],
                                  parents=None if self.tree is None else self.tree.parents[: len(paths)])
        return drafts

    def _batch(self, seqs: list[DraftContext], num_tokens: list[int]
               ) -> list[tuple[int, _SequenceState, list[tuple[int, ...]]]]:
        """(index, state, draft paths) of the sequences that draft now: those asked for drafts
        that can draft (_can_draft) and get cache blocks for their catch-up pairs and every
        draft step. Where the pool runs out, a sequence skips drafting this step (drafts
        are optional: its output is the same)."""
        wanted = [(index, self._paths(k)) for index, (seq, k) in enumerate(zip(seqs, num_tokens))
                  if k > 0 and self._can_draft(seq)]
        if not wanted:
            return []
        num_steps = max(len(path) for _, paths in wanted for path in paths) - 1  # each sequence takes every step
        return [(index, self._states[seqs[index].seq_id], paths) for index, paths in wanted
                if self.cache.reserve(seqs[index].seq_id, self._num_new_pairs(seqs[index]) + num_steps)]

    def _paths(self, k: int) -> list[tuple[int, ...]]:
        """The draft nodes as candidate-rank paths: a chain k deep, or the tree's first k
        nodes (a prefix of its depth-first order is a subtree)."""
        return [(0,) * (d + 1) for d in range(k)] if self.tree is None else self.tree.paths[:k]

    def _next_pair(self, seq_id: str) -> int:
        """The position of the sequence's first pair not cached yet."""
        return self._states[seq_id].start + self.cache.length(seq_id)

    def _num_new_pairs(self, seq: DraftContext) -> int:
        """Pairs to catch up on: up to the newest token's predecessor."""
        return seq.num_tokens - 1 - self._next_pair(seq.seq_id)

    def _can_draft(self, seq: DraftContext) -> bool:
        """Whether the sequence has pairs to catch up on and they reach its newest token's
        predecessor (a feature for every position since the pairs started)."""
        state = self._states.get(seq.seq_id)
        return state is not None and 0 < self._num_new_pairs(seq) <= len(state.features)

    def retain(self, seq_ids: Iterable[str]) -> None:
        keep = set(seq_ids)
        for seq_id in [s for s in self._states if s not in keep]:
            del self._states[seq_id]
        self.cache.retain(keep)
