"""On a GPU: a mixed batch of three adapters and the base model, decode steps replaying CUDA
graphs and prefills running the Triton LoRA kernels eagerly, against PEFT on the CPU."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import load_model
from tests.lora.peft_adapters import greedy_with_logprobs, make_adapter
from tests.lora.tiny_model import random_prompt, save_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("num_seqs", [8, 72], ids=["per-token", "grouped-in-graphs"])
def test_mixed_adapters_with_cuda_graphs_match_peft(num_seqs, tmp_path, monkeypatch) -> None:
    """8 sequences: prefills grouped by slot (SGMV, over 64 tokens), decodes per token in
    graphs; 72: decode graphs of 72 tokens replay the grouping and the grouped kernels."""
    from kvserve.lora import LoRARequest
    from kvserve import envs
    from kvserve.lora import layers

    base = save_tiny_llama(str(tmp_path / "model"))
    peft_models, adapters = [], []
    for index, rank in enumerate([4, 8, 16], start=1):
        peft_models.append(make_adapter(base, str(tmp_path / f"a{index}"), rank, seed=index))
        adapters.append(LoRARequest(f"a{index}", index, str(tmp_path / f"a{index}")))
    prompts = [random_prompt(7 + 2 * (i % 8), seed=i) for i in range(num_seqs)]
    loras = [None if i % 4 == 3 else adapters[i % 3] for i in range(num_seqs)]
    references = [greedy_with_logprobs(base if lora is None else peft_models[lora.lora_int_id - 1], prompt, 10)[0]
                  for prompt, lora in zip(prompts, loras)]
    grouped = []
    sgmv_shrink = layers.sgmv_shrink
    monkeypatch.setattr(layers, "sgmv_shrink", lambda x, *args: grouped.append(x.shape[0]) or sgmv_shrink(x, *args))
    llm = LLM(loaded=load_model(str(tmp_path / "model"), dtype=torch.float32, device="cuda"), device="cuda",
              dtype="float32", enable_lora=True, block_size=16, max_num_seqs=num_seqs, gpu_memory_utilization=0.3)
    graphs = llm.engine.core.runner.cuda_graphs
    assert graphs is not None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), lora_request=loras)
    assert [list(o.outputs[0].token_ids) for o in outputs] == references
    assert any(tokens >= envs.KVSERVE_LORA_SGMV_MIN_TOKENS for tokens in grouped)
    if num_seqs > envs.KVSERVE_LORA_SGMV_MIN_TOKENS:
        assert any(bucket >= num_seqs for bucket, _, _ in graphs.replays)
