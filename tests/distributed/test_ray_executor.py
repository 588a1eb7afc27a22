"""The ray backend of tensor and pipeline parallelism on a local Ray runtime: the same
tokens as one process (two stages with two steps in flight), and a clear error without a
cluster."""

from __future__ import annotations

import pytest
import ray

from kvserve import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import _save_tiny


def test_two_ray_actors_generate_the_one_process_tokens(tmp_path_factory):
    model_dir = _save_tiny(tmp_path_factory, tie_word_embeddings=False)
    prompts = [{"prompt_token_ids": [(3 * i + j) % 250 for j in range(6 + 5 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB")
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **kwargs)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        llm.engine.shutdown()
    finally:
        ray.shutdown()


def test_no_cluster_is_a_clear_error(tmp_path_factory, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model_dir = _save_tiny(tmp_path_factory)
    with pytest.raises(ValueError, match="found no Ray cluster"):
        LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")


@pytest.mark.slow
def test_two_ray_stages_run_two_steps_at_once(tmp_path_factory):
    model_dir = _save_tiny(tmp_path_factory, num_hidden_layers=2)
    prompts = [{"prompt_token_ids": [(3 * i + j) % 250 for j in range(6 + 5 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=24)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        llm = LLM(model_dir, pipeline_parallel_size=2, distributed_executor_backend="ray", **kwargs)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.core.most_batches_in_flight == 2
        llm.engine.shutdown()
    finally:
        ray.shutdown()
