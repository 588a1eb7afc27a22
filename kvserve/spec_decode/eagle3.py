"""EAGLE-3 heads (Li et al. 2025): the pair at position t fuses the target's residual stream
at a low, a middle and a high layer (`fc`, [H, 3H]) with the embedding of token t + 1; the
draft layer normalises both (`hidden_norm`, `input_layernorm`), attends over their
concatenation ([2H] queries/keys/values inputs), and its output estimates the next feature,
which the head's own LM head over a reduced draft vocabulary turns into a token
(token = draft id + d2t[draft id]). Later draft steps feed that output back instead of fc's.

Checkpoints in the EAGLE repository's layout (also vLLM's and SGLang's): a Llama
`config.json` with `draft_vocab_size` (and optionally `eagle_config.eagle_aux_hidden_state_layer_ids`),
weights `fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [draft vocab, H], `d2t` [draft vocab] (and `t2d`, unused
here). The target's layers read are, as in EAGLE-3 and vLLM, the residual stream entering
layers (2, L // 2, L - 3) unless the config names others.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model_executor.layers.linear import linear
from kvserve.spec_decode.eagle import (EagleCache, _rms_norm, draft_layer, draft_vocab_of, read_eagle_checkpoint,
                                      top_ids)
from kvserve.spec_decode.paged_draft_cache import DraftRows


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 draft_vocab_size: int, rope_theta: float, rms_norm_eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden_size, self.rope_theta, self.eps = hidden_size, rope_theta, rms_norm_eps
        self.fc = nn.Linear(3 * hidden_size, hidden_size, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(hidden_size))
        self.hidden_norm = nn.Parameter(torch.ones(hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden_size))
        self.norm = nn.Parameter(torch.ones(hidden_size))
        self.q_proj = nn.Linear(2 * hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: EagleCache | DraftRows) -> torch.Tensor:
        """Outputs [m, H] of m pairs at `positions`; `features` are the target's fused layers
        [m, 3H] (fc applies) or earlier outputs [m, H] (DraftRows: several sequences' pairs
        in a paged cache, batched)."""
        if features.shape[-1] != self.hidden_size:
            features = linear(features, self.fc.weight)
        x = torch.cat([_rms_norm(embeds, self.input_layernorm, self.eps),
                       _rms_norm(features, self.hidden_norm, self.eps)], dim=-1)
        return draft_layer(self, x, features, positions, cache)

    def draft_token_ids(self, outputs: torch.Tensor, n: int = 1) -> torch.Tensor:
        """Target token ids [m, n] of the draft LM head's best n, best first (draft vocabulary
        mapped by d2t)."""
        draft_ids = top_ids(linear(_rms_norm(outputs, self.norm, self.eps), self.lm_head.weight), n)
        return draft_ids + self.d2t[draft_ids]


def load_eagle3_head(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device
                     ) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head at `path` and the target layers it reads, checked against the target."""
    config, state = read_eagle_checkpoint(
        path, "an EAGLE-3 checkpoint directory (a Llama config.json with draft_vocab_size, and the head's weights)")
    fc = state.get("fc.weight")
    if fc is None or state.get("d2t") is None or state.get("lm_head.weight") is None:
        raise ValueError(f"speculative_config: model={path!r} lacks EAGLE-3's fc.weight, lm_head.weight or d2t; "
                         f"found {sorted(state)[:6]}")
    hidden_size = fc.shape[0]
    if hidden_size != target.hidden_size or fc.shape[1] != 3 * hidden_size:
        raise ValueError(f"speculative_config: model={path!r} fuses [{fc.shape[1]}] inputs into hidden size "
                         f"{hidden_size}; allowed: three of the target's layers, fc.weight "
                         f"[{target.hidden_size}, {3 * target.hidden_size}]")
    layers = tuple((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                   or default_aux_layers(target.num_hidden_layers))
    if len(layers) != 3 or not all(0 <= layer < target.num_hidden_layers for layer in layers):
        raise ValueError(f"speculative_config: model={path!r} reads target layers {list(layers)}; allowed: three "
                         f"layers in [0, {target.num_hidden_layers}) (the target has {target.num_hidden_layers})")
    draft_vocab = state["lm_head.weight"].shape[0]
    draft_vocab_of(state["d2t"], draft_vocab, path, target)
    num_heads = config.get("num_attention_heads", target.num_attention_heads)
    head = Eagle3Head(
        hidden_size, num_heads, config.get("num_key_value_heads", num_heads),
        config.get("head_dim") or hidden_size // num_heads,
        config.get("intermediate_size", state["midlayer.mlp.gate_proj.weight"].shape[0]
                   if "midlayer.mlp.gate_proj.weight" in state else 4 * hidden_size),
        draft_vocab, config.get("rope_theta", 10000.0), config.get("rms_norm_eps", 1e-6))
    names = {"fc.weight": "fc.weight", "norm": "norm.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t"}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        names[norm] = f"midlayer.{norm}.weight"
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"{proj}.weight"] = f"midlayer.self_attn.{proj}.weight"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"{proj}.weight"] = f"midlayer.mlp.{proj}.weight"
    ours = {name: state.get(theirs) for name, theirs in names.items()}
    missing = [names[name] for name, tensor in ours.items() if tensor is None]
    if missing:
        raise ValueError(f"speculative_config: model={path!r} lacks {missing[:4]} (EAGLE-3's draft layer)")
    ours["d2t"] = ours["d2t"].long()
    try:
        head.load_state_dict(ours)
    except RuntimeError as error:
        raise ValueError(f"speculative_config: model={path!r}: its tensors do not fit its config.json: {error}") from None
    return head.to(device=device, dtype=dtype).eval(), layers
