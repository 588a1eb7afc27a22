"""EAGLE-3 heads: the loader and cached steps against the paper's draft layer written here,
the draft vocabulary mapping, bad checkpoints, what the target hands the head (its residual
streams at three layers, as transformers computes them) and greedy output identical to no
speculation on a tiny Llama."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.eagle import EagleProposer, paged_draft_cache
from kvserve.spec_decode.eagle3 import load_eagle3_head
from tests.spec_decode.conftest import save_tiny_llama

VOCAB, DRAFT_VOCAB, HIDDEN, HEADS, KV_HEADS = 24, 10, 32, 4, 2
AUX_LAYERS = [0, 1, 2]


class ReferenceEagle3(nn.Module):
    """EAGLE-3's draft layer (Li et al. 2025): fc fuses three target layers; queries, keys and
    values read [input_layernorm(embedding), hidden_norm(feature)]; a Llama MLP block; the
    draft LM head after a final norm, over a reduced vocabulary mapped back by d2t."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.hidden_size // config.num_attention_heads
        self.config = config
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(h, 1e-6), LlamaRMSNorm(h, 1e-6)
        self.post_attention_layernorm, self.norm = LlamaRMSNorm(h, 1e-6), LlamaRMSNorm(h, 1e-6)
        self.q_proj = nn.Linear(2 * h, HEADS * d, bias=False)
        self.k_proj = nn.Linear(2 * h, KV_HEADS * d, bias=False)
        self.v_proj = nn.Linear(2 * h, KV_HEADS * d, bias=False)
        self.o_proj = nn.Linear(HEADS * d, h, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(h, 48, bias=False), nn.Linear(h, 48, bias=False)
        self.down_proj = nn.Linear(48, h, bias=False)
        self.lm_head = nn.Linear(h, DRAFT_VOCAB, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, fused: torch.Tensor) -> torch.Tensor:
        """Outputs of n pairs (embedding, fused feature), causally from position 0."""
        n, d = fused.shape[0], HIDDEN // HEADS
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(fused)], dim=-1)
        q = self.q_proj(x).view(n, HEADS, d).transpose(0, 1)[None]
        k = self.k_proj(x).view(n, KV_HEADS, d).transpose(0, 1)[None]
        v = self.v_proj(x).view(n, KV_HEADS, d).transpose(0, 1)[None]
        cos, sin = self.rotary(x[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = (q @ k.transpose(-1, -2)) / d**0.5 + torch.full((n, n), float("-inf")).triu(1)
        attended = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(n, -1)
        hidden = fused + self.o_proj(attended)
        h = self.post_attention_layernorm(hidden)
        return hidden + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    def eagle_layout(self, d2t: torch.Tensor) -> dict[str, torch.Tensor]:
        state = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
                 "lm_head.weight": self.lm_head.weight, "d2t": d2t, "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            state[f"midlayer.{name}.weight"] = getattr(self, name).weight
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"midlayer.self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[f"midlayer.mlp.{name}.weight"] = getattr(self, name).weight
        return {k: v.detach().contiguous() for k, v in state.items()}


def _config(layers=AUX_LAYERS) -> LlamaConfig:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6)
    config.draft_vocab_size = DRAFT_VOCAB
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": layers}
    return config


D2T = torch.tensor([3, 3, 5, 5, 5, 8, 8, 9, 10, 11])  # draft id d is token d + d2t[d]


def save_eagle3(directory: str, seed: int, d2t: torch.Tensor = D2T, layers=AUX_LAYERS, hidden: int = HIDDEN) -> str:
    torch.manual_seed(seed)
    config = _config(layers)
    reference = ReferenceEagle3(config)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0, 0.3)
    state = reference.eagle_layout(d2t)
    if hidden != HIDDEN:
        state["fc.weight"] = torch.randn(hidden, 3 * hidden)
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    save_file(state, os.path.join(directory, "model.safetensors"))
    torch.save(reference.state_dict(), os.path.join(directory, "reference.pt"))
    return directory


TARGET = SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB, num_attention_heads=HEADS, num_hidden_layers=4)


def test_cached_steps_and_vocabulary_match_the_paper_head(tmp_path) -> None:
    path = save_eagle3(str(tmp_path / "h"), seed=1)
    reference = ReferenceEagle3(_config())
    reference.load_state_dict(torch.load(os.path.join(path, "reference.pt")))
    head, layers = load_eagle3_head(path, TARGET, torch.float32, torch.device("cpu"))
    assert layers == tuple(AUX_LAYERS)
    embeds, target_layers = torch.randn(6, HIDDEN), torch.randn(5, 3 * HIDDEN)
    with torch.no_grad():
        cache = paged_draft_cache(head, num_blocks=3, block_size=2)
        assert cache.reserve("s", 6)
        caught_up = torch.cat([head(embeds[:3], target_layers[:3], torch.arange(3), cache.extend(["s"], [3])),
                               head(embeds[3:5], target_layers[3:5], torch.arange(3, 5), cache.extend(["s"], [2]))])
        drafted = head(embeds[5:], caught_up[-1:], torch.arange(5, 6), cache.extend(["s"], [1]))  # fed back: no fc
        expected = reference(embeds, torch.cat([reference.fc(target_layers), caught_up[-1:]]))
        torch.testing.assert_close(torch.cat([caught_up, drafted]), expected, rtol=1e-4, atol=1e-4)
        draft_ids = reference.lm_head(reference.norm(expected)).argmax(-1)
        assert head.draft_token_ids(expected)[:, 0].tolist() == (draft_ids + D2T[draft_ids]).tolist()
        top3 = reference.lm_head(reference.norm(expected)).argsort(dim=-1, descending=True)[:, :3]
        assert head.draft_token_ids(expected, 3).tolist() == (top3 + D2T[top3]).tolist()


def test_bad_heads_are_clear_errors_at_load(tmp_path) -> None:
    with pytest.raises(ValueError, match="reads target layers \\[0, 1, 4\\]; allowed: three layers in \\[0, 4\\)"):
        load_eagle3_head(save_eagle3(str(tmp_path / "a"), 0, layers=[0, 1, 4]), TARGET, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="maps its 10 draft tokens to ids in \\[3, 24\\]; allowed: the target's "
                                         "vocabulary \\[0, 24\\)"):
        bad = D2T.clone()
        bad[-1] = 15
        load_eagle3_head(save_eagle3(str(tmp_path / "b"), 0, d2t=bad), TARGET, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="fuses \\[144\\] inputs into hidden size 48; allowed"):
        load_eagle3_head(save_eagle3(str(tmp_path / "c"), 0, hidden=48), TARGET, torch.float32, torch.device("cpu"))
    os.makedirs(tmp_path / "d")
    with open(tmp_path / "d" / "config.json", "w") as f:
        json.dump({}, f)
    save_file({"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks EAGLE-3's fc.weight, lm_head.weight or d2t"):
        load_eagle3_head(str(tmp_path / "d"), TARGET, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), vocab_size=VOCAB, hidden_size=HIDDEN,
                           num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)


@pytest.mark.parametrize("norms", ["as on cpu", "in place",
                                   pytest.param("compiled", marks=pytest.mark.slow)])  # ~20 s of compiling
def test_greedy_is_exact_and_the_head_reads_the_targets_layers(norms, tiny_llama, tmp_path, monkeypatch) -> None:
    """"in place": the residual adds update the stream in place, as the CUDA kernels do; the
    streams handed to the head must still be each layer's own. "compiled": decode and
    verify steps run the compiled CPU graph, which returns the streams too."""
    observed: dict[str, dict[int, torch.Tensor]] = {}
    observe = EagleProposer.observe
    if norms == "in place":
        from kvserve.model_executor.layers.layernorm import RMSNorm

        forward = RMSNorm.forward

        def in_place(self, x, residual=None):
            if residual is None:
                return forward(self, x)
            out, updated = forward(self, x, residual)
            return out, residual.copy_(updated)

        monkeypatch.setattr(RMSNorm, "forward", in_place)

    def recording(self, seq_id, first_position, features):
        for i, feature in enumerate(features):
            observed.setdefault(seq_id, {})[first_position + i] = feature.clone()
        observe(self, seq_id, first_position, features)

    monkeypatch.setattr(EagleProposer, "observe", recording)
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in (19, 6, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(skip_tokenizer_init=True, kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=9)
    plain = LLM(model=tiny_llama, **kwargs).generate(prompts, params)
    spec = LLM(model=tiny_llama, **kwargs, compile_decode=norms == "compiled", speculative_config={
        "method": "eagle3", "model": save_eagle3(str(tmp_path / "h"), seed=2), "num_speculative_tokens": 3})
    compiled_steps = []
    if norms == "compiled":
        compiled = spec.engine.core.runner.compiled_decode
        forward = compiled.forward_with_streams

        def recording_forward(*args):
            hidden, streams = forward(*args)
            compiled_steps.append(streams)
            return hidden, streams

        compiled.forward_with_streams = recording_forward
    outputs = spec.generate(prompts, params)
    if norms == "compiled":  # the graph ran, and returned streams
        assert compiled_steps and all(streams is not None for streams in compiled_steps)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.spec_decode_stats.num_drafts > 0
    tokens = prompts[0]["prompt_token_ids"] + list(outputs[0].outputs[0].token_ids)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        streams = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([streams[layer][0] for layer in AUX_LAYERS], dim=-1)
    [first] = [features for features in observed.values() if len(features) == len(tokens) - 1]
    assert sorted(first) == list(range(len(tokens) - 1))  # every position but the last token's
    torch.testing.assert_close(torch.stack([first[p] for p in sorted(first)]), expected[:-1], rtol=1e-4, atol=1e-4)
