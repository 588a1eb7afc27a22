"""Speculative decoding on the GPU's Triton attention backend: greedy output with drafts
(n-gram, a draft model, and partly right scripted drafts) equals plain greedy output, with
verify steps replayed from CUDA graphs (sequences with fewer drafts padded) and eagerly."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from tests.spec_decode.proposers import ScriptedProposer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_triton_verify_matches_plain_greedy(save_hf_model, enforce_eager):
    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )
    target_dir = save_hf_model(LlamaForCausalLM(config), "target", seed=0)
    small = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    draft_dir = save_hf_model(LlamaForCausalLM(small), "draft", seed=1)
    generator = torch.Generator().manual_seed(2)
    pieces = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (5, 20, 37, 64)]
    prompts = [p * 3 for p in pieces]  # repetition for prompt lookup to find
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(model=target_dir, dtype="float32", device="cuda", attention_backend="triton",
                  max_num_batched_tokens=96, gpu_memory_utilization=0.3,
                  enforce_eager=enforce_eager)

    def run(speculative_config=None, proposer=None):
        llm = LLM(**common, speculative_config=speculative_config)
        if proposer is not None:
            llm.engine.core.runner.speculator.proposer = proposer
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.spec_decode_stats
        assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.runner.num_blocks
        graphs = llm.engine.core.runner.cuda_graphs
        if speculative_config is not None and not enforce_eager:
            assert any(width > 1 for _, width, _ in graphs.graphs), "no verify step replayed"
        return [list(o.outputs[0].token_ids) for o in outputs], stats

    plain, _ = run()
    # A random model's output rarely repeats its prompt: matching on one token makes drafts
    # (of varying lengths, so verify batches mix widths) certain.
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    got, stats = run(ngram)
    assert got == plain and stats.num_drafts > 0
    scripted = ScriptedProposer({tuple(p): o for p, o in zip(prompts, plain)}, 1024, num_correct=2)
    got, stats = run(ngram, scripted)
    assert got == plain and stats.num_accepted_tokens >= 2 * stats.num_drafts
    got, stats = run({"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3})
    assert got == plain and stats.num_drafts > 0
