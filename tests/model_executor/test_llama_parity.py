"""kvserve's decoder on a paged cache against transformers, per architecture."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kvserve.model_executor.loader import load_model

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500000.0}

ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "llama-tied-llama3-rope": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": lambda: LlamaForCausalLM(LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)),
    # A window shorter than the 27-token sequence, off block boundaries, so it really cuts.
    "mistral-sliding-window": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=7)),
    "qwen2-tied-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "qwen3-qk-norm": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=32)),
    # Top 2 of 4 experts: over 27 tokens every expert runs, each on some tokens only.
    "mixtral-moe": lambda: MixtralForCausalLM(
        MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # A shared expert, top-k weights not renormalised, and layer 0 dense (mlp_only_layers).
    "qwen2-moe-shared-expert": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[0])),
    # Renormalised top-k, q/k norms, every second layer sparse (decoder_sparse_step).
    "qwen3-moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **{**SMALL, "num_hidden_layers": 3}, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=40, norm_topk_prob=True, decoder_sparse_step=2)),
}


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_prefill_chunks_and_decodes_match_transformers(arch, save_hf_model, paged_runner) -> None:
    hf_model = ARCHITECTURES[arch]().eval()
    loaded = load_model(save_hf_model(hf_model))
    prompt = torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(1)).tolist()

    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
            pad_token_id=0,
        )[0, len(prompt):].tolist()
    expected = reference_logits(hf_model, prompt + generated)

    # Prefill in chunks of 6 and 5 (block size 4), then greedy single-token decodes.
    runner = paged_runner(loaded.model, loaded.config)
    logits = [runner.step([(0, prompt[:6])])[0], runner.step([(0, prompt[6:])])[0]]
    ours: list[int] = []
    for _ in range(16):
        ours.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, [ours[-1]])])[0])
    assert ours == generated
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=0)


def test_mixed_batch_matches_single_sequences(save_hf_model, paged_runner) -> None:
    hf_model = ARCHITECTURES["qwen2-tied-bias"]().eval()
    loaded = load_model(save_hf_model(hf_model))
    gen = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 13, 12))
    runner = paged_runner(loaded.model, loaded.config)
    runner.step([(0, a[:8]), (2, c[:6])])  # earlier step: a's prompt and c's first chunk
    # One step: a decodes, b prefills from scratch, c prefills on top of its cached prefix.
    out_a, out_b, out_c = runner.step([(0, a[8:]), (1, b), (2, c[6:])])
    torch.testing.assert_close(out_a, reference_logits(hf_model, a)[8:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out_b, reference_logits(hf_model, b), atol=1e-4, rtol=0)
    torch.testing.assert_close(out_c, reference_logits(hf_model, c)[6:], atol=1e-4, rtol=0)


def test_sharded_safetensors(save_hf_model, paged_runner) -> None:
    hf_model = ARCHITECTURES["llama"]().eval()
    directory = save_hf_model(hf_model, max_shard_size="60KB")
    assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
    assert sum(n.endswith(".safetensors") for n in os.listdir(directory)) > 2
    loaded = load_model(directory)
    tokens = list(range(3, 20))
    (logits,) = paged_runner(loaded.model, loaded.config).step([(0, tokens)])
    torch.testing.assert_close(logits, reference_logits(hf_model, tokens), atol=1e-4, rtol=0)


def test_config_from_hf_dir(save_hf_model) -> None:
    hf_model = ARCHITECTURES["llama-tied-llama3-rope"]()
    config = load_model(save_hf_model(hf_model)).config
    assert config.architecture == "LlamaForCausalLM"
    assert config.tie_word_embeddings and config.head_dim == 16 and config.num_key_value_heads == 2
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    assert config.eos_token_ids == [hf_model.config.eos_token_id]
    assert config.dtype == torch.float32
