"""The real SmolLM2 through the whole engine with quantized linears: int8 stays close to
fp32 (greedy tokens and teacher-forced top-1 agreement), int4 and nf4 run end to end."""

from __future__ import annotations

import copy

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import LoadedModel
from kvserve.quantization import QuantizedLinear, get_quantization_method, quantize_model

from tests.quantization.prompts import PROMPTS
NUM_NEW_TOKENS = 24


def _quantized_copy(loaded: LoadedModel, method: str) -> LoadedModel:
    """The session's fp32 model stays untouched: quantizing swaps modules in place."""
    model = copy.deepcopy(loaded.model)
    quantize_model(model, get_quantization_method(method))
    return LoadedModel(model, loaded.config, loaded.tokenizer)


def _greedy(llm: LLM, prompt_ids: list[list[int]], max_tokens: int = NUM_NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def prompt_ids(smollm2_loaded) -> list[list[int]]:
    return [smollm2_loaded.tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def fp32_greedy(smollm2_loaded, prompt_ids) -> list[list[int]]:
    return _greedy(LLM(loaded=smollm2_loaded, kv_cache_memory="128MiB", max_model_len=2048, enable_prefix_caching=False), prompt_ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _top1_agreement(llm: LLM, prompt_ids: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of the reference's generated positions where this model's argmax, fed
    the reference's own prefix (teacher forcing), picks the reference's token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    sequences = [ids + ref for ids, ref in zip(prompt_ids, reference)]
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params)
    agree = total = 0
    for ids, ref, output in zip(prompt_ids, reference, outputs):
        # prompt_logprobs[i] scores token i given tokens < i; include the top-1 token.
        for position, token in enumerate(ref, start=len(ids)):
            logprobs = output.prompt_logprobs[position]
            agree += max(logprobs, key=logprobs.get) == token
            total += 1
    return agree / total


def test_int8_greedy_agrees_with_fp32(smollm2_loaded, prompt_ids, fp32_greedy):
    loaded = _quantized_copy(smollm2_loaded, "int8")
    # 120 linears and, on CPU by default, the int8 copy of the LM head.
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.model.modules()) == 121
    assert loaded.model.quantized_lm_head is not None
    llm = LLM(loaded=loaded, kv_cache_memory="128MiB", max_model_len=2048, enable_prefix_caching=False)
    int8_greedy = _greedy(llm, prompt_ids)
    # Greedy paths diverge for good once one near-tie flips, so compare the first tokens.
    same_prefix = [_common_prefix(a, b) for a, b in zip(int8_greedy, fp32_greedy)]
    agreement = _top1_agreement(llm, prompt_ids, fp32_greedy)
    print(f"int8 vs fp32: identical prefix lengths {same_prefix} of {NUM_NEW_TOKENS}, "
          f"top-1 agreement {agreement:.3f}")
    assert sum(n >= 4 for n in same_prefix) > len(PROMPTS) // 2
    assert agreement >= 0.93


@pytest.mark.parametrize("method", ["int4", "nf4"])
def test_four_bit_methods_run_end_to_end(smollm2_loaded, prompt_ids, fp32_greedy, method):
    llm = LLM(loaded=_quantized_copy(smollm2_loaded, method), kv_cache_memory="128MiB", max_model_len=2048, enable_prefix_caching=False)
    outputs = _greedy(llm, prompt_ids[:3], max_tokens=8)
    assert [len(o) for o in outputs] == [8, 8, 8]
    agreement = _top1_agreement(llm, prompt_ids, fp32_greedy)
    print(f"{method} vs fp32: top-1 agreement {agreement:.3f}")
    assert agreement >= 0.6  # 4 bits on a 135M model: a loose floor, the number is reported
