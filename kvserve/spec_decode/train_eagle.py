"""EAGLE-1 heads trained by self-distillation (`kvserve train-drafter --method eagle`).

The target scores each chunk (its last hidden states f_t and greedy predictions). The head
sees the pairs (embedding of token t + 1, f_t) of the whole chunk in one causal pass and
estimates f_{t+1} at each t; EAGLE's loss: SmoothL1(f̂_{t+1}, f_{t+1}) + w_cls x the cross
entropy of the target's LM head over f̂_{t+1} against the target's greedy prediction at
t + 1 (EAGLE's w_cls: 0.1). The target's embedding and LM head stay frozen and are not
saved: the served drafter uses the target's.

The head starts as the identity on f_t: fc passes the feature through (its embedding half
and bias zero) and the decoder layer's output projections (o_proj, down_proj) are zero, so
both residual branches add nothing yet (Medusa's zero residual block, for the same reason:
training starts from "the next feature is this one", not from noise); the other projections
are nn.Linear's random init so gradients reach them once the output projections move.

Two of EAGLE's remedies for a head that drifts once fed its own estimates: uniform noise
U(-a/2, a/2) on the input features in training only (`feature_noise` = a; EAGLE's data
loader adds such noise), and unrolled draft steps (EAGLE-3's training-time test): step k
feeds step k - 1's estimate and the target's greedy token back in at position t + k - 1, as
drafting does, attending the true pairs up to t and its own chain only; step k's loss is
weighted `unroll_decay` ** (k - 1). A draft vocabulary (the most predicted target tokens)
restricts the LM head used for the cross entropy and for drafting to its rows; it is saved as
EAGLE-3's d2t (target id = draft id + d2t[draft id]).

Held-out acceptance per draft position j is measured as served: after the true pairs up to
a position s, the head chains on its own estimates and drafted tokens; position j counts as
accepted when drafts 1..j all equal the target's greedy continuation. Only the text gives
that continuation without running the target, so position j is measured at the positions s
where the text itself follows the target's greedy choice for j - 1 tokens, and token s is
the greedy one too: the measure covers text the model generated greedily (all its
positions) and leaves out prompts, whose shared parts (a chat template's system prompt) a
head learns by heart and whose acceptance would overstate what serving sees.
"""

from __future__ import annotations

import json
import os
import random

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from kvserve.llm import LLM
from kvserve.spec_decode.eagle import EagleCache, EagleHead, draft_layer
from kvserve.spec_decode.train_drafter import most_predicted_tokens, to_draft_labels

GRAD_CLIP = 0.5  # the EAGLE repository's gradient norm clip

# (token ids [n], target features [n, H], target greedy predictions [n]) of one chunk.
ScoredChunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def new_head(llm: LLM) -> EagleHead:
    """A random EAGLE-1 head shaped for the target (its hidden size, heads, MLP width, RoPE)."""
    config = llm.engine.model_config
    return EagleHead(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                     config.intermediate_size, config.rope_theta, config.rms_norm_eps, fc_bias=True)


def identity_head(llm: LLM) -> EagleHead:
    """A head whose first estimate of f_{t+1} is f_t (see the module's docstring)."""
    head = new_head(llm)
    hidden_size = head.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden_size:].copy_(torch.eye(hidden_size))
        head.fc.bias.zero_()
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
    return head


class FrozenTarget:
    """The target's embedding and LM head (its rows of `draft_vocab` where given), fp32
    copies outside the engine's modules."""

    def __init__(self, embedding: torch.Tensor, lm_head: torch.Tensor, draft_vocab: torch.Tensor | None = None) -> None:
        self.embedding, self.vocab_size, self.draft_vocab = embedding, lm_head.shape[0], draft_vocab
        self.lm_head = lm_head if draft_vocab is None else lm_head[draft_vocab]

    @classmethod
    def of(cls, llm: LLM, draft_vocab: torch.Tensor | None = None) -> FrozenTarget:
        model, config = llm.engine.core.runner.model, llm.engine.model_config
        embedding = model.model.embed_tokens.weight.detach().float()
        lm_head = embedding if config.tie_word_embeddings else model.lm_head.weight.detach().float()
        return cls(embedding, lm_head, draft_vocab)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embedding)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary's rows (the whole vocabulary without one)."""
        return F.linear(features, self.lm_head)

    def draft_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """Target token ids of the draft tokens the estimated features give (as served)."""
        rows = self.logits(features).argmax(dim=-1)
        return rows if self.draft_vocab is None else self.draft_vocab[rows]

    def labels(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target tokens as rows of logits(), -100 (ignored) outside the draft vocabulary."""
        return to_draft_labels(token_ids, self.draft_vocab, self.vocab_size)


def unrolled_mask(num_pairs: int, num_rows: int, step: int) -> torch.Tensor:
    """[num_rows, cached + num_rows] attention of unrolled step `step` (>= 2) over the cached
    keys of steps 1 .. step - 1 (num_pairs, num_pairs - 1, .. rows) and its own: row i attends
    step 1's rows 0..i (the true pairs up to t = i) and row i of every later step."""
    rows = torch.arange(num_rows)[:, None]
    blocks = [torch.arange(num_pairs)[None, :] <= rows]
    blocks += [torch.arange(num_pairs - k)[None, :] == rows for k in range(1, step)]
    return torch.cat(blocks, dim=1)


def eagle_loss(head: EagleHead, target: FrozenTarget, chunk: ScoredChunk, cls_weight: float,
               feature_noise: float = 0.0, num_steps: int = 1, unroll_decay: float = 0.8) -> torch.Tensor:
    """EAGLE-1's loss over one chunk's pairs t = 0 .. n - 2, plus unrolled steps 2..num_steps
    (see the module's docstring); `feature_noise` perturbs step 1's input features."""
    token_ids, features, predictions = chunk
    n = token_ids.shape[0]
    inputs = features[:-1]
    if feature_noise:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * feature_noise
    cache = EagleCache()
    estimates = head(target.embed(token_ids[1:]), inputs, torch.arange(n - 1), cache)
    loss = F.smooth_l1_loss(estimates, features[1:]) + cls_weight * F.cross_entropy(
        target.logits(estimates), target.labels(predictions[1:]), ignore_index=-100)
    for step in range(2, num_steps + 1):
        rows = n - step  # pairs t = 0 .. n - 1 - step have a feature `step` places ahead
        if rows < 1:
            break
        x = F.linear(torch.cat([target.embed(predictions[step - 1 : step - 1 + rows]), estimates[:rows]], -1),
                     head.fc.weight, head.fc.bias)
        estimates = draft_layer(head, x, x, torch.arange(step - 1, step - 1 + rows), cache,
                                unrolled_mask(n - 1, rows, step))
        step_loss = F.smooth_l1_loss(estimates, features[step:]) + cls_weight * F.cross_entropy(
            target.logits(estimates), target.labels(predictions[step:]), ignore_index=-100)
        loss = loss + unroll_decay ** (step - 1) * step_loss
    return loss


@torch.no_grad()
def chained_acceptance(head: EagleHead, target: FrozenTarget, chunks: list[ScoredChunk],
                       num_tokens: int) -> list[float]:
    """Per draft position 1..num_tokens, the fraction of measured positions where the chained
    drafts through it all equal the target's greedy continuation (nan: none measured)."""
    hits, counts = torch.zeros(num_tokens), torch.zeros(num_tokens)
    for token_ids, features, predictions in chunks:
        n = token_ids.shape[0]
        cache = EagleCache()
        # One pass over the true pairs: every position's first estimate and the cached keys.
        first = head(target.embed(token_ids[1:]), features[:-1], torch.arange(n - 1), cache)
        follows_greedy = (token_ids[1:] == predictions[:-1]).tolist()  # token s + 1 is the greedy one
        for s in range(1, n):  # tokens 0..s known, pairs 0..s-1 verified
            if not follows_greedy[s - 1]:  # prompt text, not generated
                continue
            # Positions j whose greedy continuation the text gives: s + j < n, tokens s+1..s+j-1 greedy.
            known = 0
            while known < num_tokens and s + known < n and (known == 0 or follows_greedy[s + known - 1]):
                known += 1
            counts[:known] += 1
            draft_cache = EagleCache(cache.keys[:s], cache.values[:s])
            estimate = first[s - 1 : s]
            for j in range(known):
                token = target.draft_tokens(estimate)
                if int(token) != int(predictions[s + j]):
                    break
                hits[j] += 1
                if j + 1 < known:
                    estimate = head(target.embed(token), estimate, torch.tensor([s + j]), draft_cache)
    # nan where no position was measured (text that never follows the target's greedy choice).
    return (hits / counts).tolist()


def train_eagle(llm: LLM, chunks: list[ScoredChunk], num_held_out: int, num_tokens: int, epochs: int, lr: float,
                cls_weight: float, seed: int, feature_noise: float = 0.0, num_steps: int = 1,
                draft_vocab_size: int = 0) -> tuple[EagleHead, torch.Tensor | None, list[float], list[float]]:
    """(trained head, its draft vocabulary or None, its held-out acceptance per draft
    position, a random head's)."""
    evaluation, training = chunks[:num_held_out], chunks[num_held_out:]
    vocab_size = llm.engine.model_config.vocab_size
    draft_vocab = None
    if 0 < draft_vocab_size < vocab_size:
        draft_vocab = most_predicted_tokens([(None, predictions) for _, _, predictions in training],
                                            vocab_size, draft_vocab_size)
    target = FrozenTarget.of(llm, draft_vocab)
    torch.manual_seed(seed)
    head = identity_head(llm)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr)
    with tqdm(total=epochs * len(training), desc="training the EAGLE head", unit="chunk") as progress:
        for _ in range(epochs):
            random.Random(seed).shuffle(training)
            for chunk in training:
                loss = eagle_loss(head, target, chunk, cls_weight, feature_noise, num_steps)
                optimizer.zero_grad()
                loss.backward()
                # EAGLE's clip: a few outlier feature channels (|f| ~50 on SmolLM2) fed back through
                # unrolled steps can otherwise blow a step up.
                torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
                optimizer.step()
                progress.set_postfix(loss=f"{loss.item():.3f}")
                progress.update()
    head.eval()
    trained = chained_acceptance(head, target, evaluation, num_tokens)
    return head, draft_vocab, trained, chained_acceptance(new_head(llm).eval(), target, evaluation, num_tokens)


def save_eagle_head(head: EagleHead, llm: LLM, out: str, draft_vocab: torch.Tensor | None = None) -> None:
    """The EAGLE repository's layout (a Llama config.json and model.safetensors), which
    `speculative_config={"method": "eagle"}` loads; a draft vocabulary as EAGLE-3's `d2t`
    (and `draft_vocab_size` in the config)."""
    os.makedirs(out, exist_ok=True)
    layer = "layers.0."
    state = {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias,
             f"{layer}post_attention_layernorm.weight": head.post_attention_layernorm}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        state[f"{layer}self_attn.{proj}.weight"] = getattr(head, proj).weight
    for proj in ("gate_proj", "up_proj", "down_proj"):
        state[f"{layer}mlp.{proj}.weight"] = getattr(head, proj).weight
    if draft_vocab is not None:
        state["d2t"] = draft_vocab - torch.arange(len(draft_vocab))
    save_file({name: tensor.detach().contiguous() for name, tensor in state.items()},
              os.path.join(out, "model.safetensors"))
    config = llm.engine.model_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                   "hidden_size": head.hidden_size, "intermediate_size": head.gate_proj.weight.shape[0],
                   "num_attention_heads": head.num_heads, "num_key_value_heads": head.num_kv_heads,
                   "rope_theta": head.rope_theta, "rms_norm_eps": head.eps, "vocab_size": config.vocab_size,
                   "bias": True, "torch_dtype": "float32",
                   **({} if draft_vocab is None else {"draft_vocab_size": len(draft_vocab)})}, f, indent=2)
