"""Mixtures of experts over two ranks: every expert's rows split (tensor parallel) or whole
experts per rank (expert parallel) generate the one-process tokens."""

from __future__ import annotations

import pytest
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from kvserve import LLM, SamplingParams

# 8 experts, top 2; Qwen2-MoE with a shared expert and a dense first layer.
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MODELS = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        **SMALL, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    "qwen2-moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[0])),
}


@pytest.mark.parametrize(("architecture", "expert_parallel"), [
    pytest.param("qwen2-moe", True, id="qwen2-moe-ep"),
    pytest.param("qwen2-moe", False, id="qwen2-moe-tp", marks=pytest.mark.slow),
    pytest.param("mixtral", True, id="mixtral-ep", marks=pytest.mark.slow),
    pytest.param("mixtral", False, id="mixtral-tp", marks=pytest.mark.slow),
])
def test_two_ranks_generate_the_one_process_tokens(save_hf_model, architecture, expert_parallel):
    model_dir = save_hf_model(MODELS[architecture](), name=architecture)
    prompts = [{"prompt_token_ids": [(13 * i + j) % 256 for j in range(6 + 9 * i)]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB")
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kwargs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.shutdown()


def test_experts_that_do_not_divide_are_refused():
    from kvserve.config import ModelConfig
    from kvserve.model_executor.tensor_parallel import check_shardable

    config = ModelConfig("MixtralForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=6, num_experts_per_tok=2, moe_intermediate_size=96)
    with pytest.raises(ValueError, match="6 experts cannot be split over 4 ranks; use a tensor_parallel_size among 1, 2, 3, 6"):
        check_shardable(config, 4, expert_parallel=True)
