"""An adapter on an int4, int8 or fp8 base (QLoRA-style: the adapter in the run dtype) computes what the
same adapter computes on the dequantized weights as a float model."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import load_model
from kvserve.quantization import QuantizedLinear
from tests.lora.tiny_model import random_prompt, save_adapters, save_tiny_llama


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_quantized_base_equals_dequantized_base(tmp_path, method) -> None:
    base = save_tiny_llama(str(tmp_path / "model"))
    adapters = save_adapters(base, str(tmp_path), [8, 16])
    quantized = load_model(str(tmp_path / "model"), dtype=torch.float32, quantization=method,
                           quantization_config={"lm_head": False} | ({} if method == "fp8" else {"group_size": 32}))
    dequantized = load_model(str(tmp_path / "model"), dtype=torch.float32)
    with torch.no_grad():
        for name, module in quantized.model.named_modules():
            if isinstance(module, QuantizedLinear):
                dequantized.model.get_submodule(name).weight.copy_(module.dequantize(torch.float32))
    prompts = [{"prompt_token_ids": random_prompt(9 + i, seed=i)} for i in range(3)]
    loras = [adapters[0], adapters[1], None]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    outputs = {}
    for kind, loaded in (("quantized", quantized), ("dequantized", dequantized)):
        llm = LLM(loaded=loaded, enable_lora=True, kv_cache_memory="16MiB", block_size=4)
        outputs[kind] = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=loras)]
    for ours, reference in zip(outputs["quantized"], outputs["dequantized"]):
        assert ours.token_ids == reference.token_ids
        for a, b in zip(ours.logprobs, reference.logprobs):
            for token_id, value in a.items():
                assert value == pytest.approx(b[token_id], abs=2e-2)
