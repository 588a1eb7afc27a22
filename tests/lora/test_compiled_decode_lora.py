"""The compiled CPU decode step serves mixed adapters as the eager step does: the per-token
slot mask and the slots' matrices are graph inputs (buffers), so an adapter put in a slot
after the graphs were compiled is seen by them."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import load_model
from tests.lora.tiny_model import random_prompt, save_adapters, save_tiny_llama


@pytest.mark.slow  # compiles the decode graphs (~30 s on 2 cores)
def test_compiled_decode_equals_eager_with_adapters(tmp_path) -> None:
    base = save_tiny_llama(str(tmp_path / "model"))
    adapters = save_adapters(base, str(tmp_path), [4, 8, 16])
    late = adapters.pop()  # first used after the graphs exist
    prompts = [{"prompt_token_ids": random_prompt(9 + i, seed=i)} for i in range(5)]
    loras = [adapters[0], adapters[1], None, adapters[1], late]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outputs = {}
    for compiled in (False, True):
        llm = LLM(loaded=load_model(str(tmp_path / "model"), dtype=torch.float32), enable_lora=True,
                  kv_cache_memory="16MiB", block_size=4, compile_decode=compiled)
        runner = llm.engine.core.runner
        llm.generate(prompts[:2], params, lora_request=loras[:2])
        if compiled:
            calls = []
            forward = runner.compiled_decode.forward
            runner.compiled_decode.forward = lambda *args: calls.append(1) or forward(*args)
        outputs[compiled] = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=loras)]
        if compiled:
            assert len(calls) >= 9  # the decode steps ran the graph
    for eager, compiled in zip(outputs[False], outputs[True]):
        assert compiled.token_ids == eager.token_ids
        for a, b in zip(eager.logprobs, compiled.logprobs):
            for token_id, value in a.items():
                assert b[token_id] == pytest.approx(value, abs=1e-4)
