"""Every bad input raises a clear ValueError before scheduling; the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.model_runner import kv_cache_bytes_per_block

VALID = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize(
    ("make_call", "expected"),
    [
        (lambda llm: llm.generate("", VALID), "prompt"),
        (lambda llm: llm.generate({"prompt_token_ids": []}, VALID), "prompt"),
        (lambda llm: llm.generate({"prompt_token_ids": [1, 49152]}, VALID), "49152"),
        (lambda llm: llm.generate({"prompt_token_ids": [-1]}, VALID), "-1"),
        (lambda llm: llm.generate("Hi", SamplingParams(temperature=-0.5)), "temperature"),
        (lambda llm: llm.generate("Hi", SamplingParams(top_p=0.0)), "top_p"),
        (lambda llm: llm.generate("Hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate("Hi", SamplingParams(top_k=0)), "top_k"),
        (lambda llm: llm.generate("Hi", SamplingParams(top_k=-2)), "top_k"),
        (lambda llm: llm.generate("Hi", SamplingParams(n=0)), "n"),
        # More samples than a step runs could never be admitted.
        (lambda llm: llm.generate("Hi", SamplingParams(n=257)), "n must be at most max_num_seqs (256), got n=257"),
        (lambda llm: llm.generate("Hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate("Hi", SamplingParams(stop=5)), "stop"),
        (lambda llm: llm.generate("Hi", SamplingParams(stop=["ok", 3])), "stop"),
        (lambda llm: llm.generate("Hi", SamplingParams(stop_token_ids=[10**6])), "stop_token_ids"),
        (lambda llm: llm.generate("Hi", SamplingParams(logit_bias={10**6: 1.0})), "logit_bias"),
        (
            lambda llm: llm.generate("Hi", SamplingParams(max_tokens=llm.engine.max_model_len)),
            "maximum context length",
        ),
        (lambda llm: llm.generate(3.5, VALID), "prompt"),
    ],
)
def test_bad_input_raises_then_engine_still_serves(smollm2_llm, make_call, expected):
    engine = smollm2_llm.engine
    with pytest.raises(ValueError) as info:
        make_call(smollm2_llm)
    assert expected in str(info.value)
    # Nothing was scheduled or leaked, and a valid request still works.
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks
    output = smollm2_llm.generate("The capital of France is", VALID)[0]
    assert len(output.outputs[0].token_ids) == 4
    assert output.outputs[0].finish_reason == "length"
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks


def test_context_overflow_message_has_the_numbers(smollm2_llm):
    engine = smollm2_llm.engine
    prompt = list(range(100, 110))
    too_many = engine.max_model_len - len(prompt) + 1
    with pytest.raises(ValueError) as info:
        smollm2_llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=too_many))
    assert str(info.value) == (
        f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
        f"requested {too_many} output tokens and your prompt contains 10 input tokens, for a "
        f"total of {too_many + 10} tokens. Please reduce the length of the input prompt or the "
        "number of requested output tokens."
    )


def test_one_bad_prompt_in_a_batch_schedules_nothing(smollm2_llm):
    engine = smollm2_llm.engine
    with pytest.raises(ValueError):
        smollm2_llm.generate(["Hello", ""], VALID)
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks


@pytest.mark.parametrize(("device", "expected"), [("tpu", "not a device name"), ("mps", "runs on cpu, cuda"),
                                                  ("cuda:99", "cuda:99")])
def test_a_device_that_is_not_here_is_an_error_before_loading(device, expected):
    if device == "cuda:99" and not torch.cuda.is_available():
        expected = "CUDA is not available"
    with pytest.raises(ValueError, match=expected):
        LLM(model="/nonexistent", device=device)  # the device is checked before the model path


def test_max_model_len_the_kv_cache_cannot_hold_refuses_to_start(smollm2_loaded):
    memory = str(91 * kv_cache_bytes_per_block(smollm2_loaded.config, 16))  # 91 blocks: 1456 tokens
    fits = LLM(loaded=smollm2_loaded, kv_cache_memory=memory, max_model_len=1456)
    assert fits.engine.core.runner.num_blocks == 91
    # A request that leaves max_tokens unset may fill the context: it fits the cache too.
    assert fits.engine.validate([1, 2, 3], SamplingParams(max_tokens=None)) == 1453
    with pytest.raises(ValueError) as info:
        LLM(loaded=smollm2_loaded, kv_cache_memory=memory, max_model_len=1457)
    assert str(info.value) == (
        "max_model_len (1457 tokens) does not fit the KV cache: one sequence of that length needs "
        "92 blocks of 16 tokens, and the cache holds 91 blocks (1456 tokens). Raise "
        "--kv-cache-memory (or use --kv-cache-dtype fp8), or lower --max-model-len to at most 1456."
    )
    with pytest.raises(ValueError, match=r"^max_model_len \(8192 tokens\) .* needs 512 blocks"):
        LLM(loaded=smollm2_loaded, kv_cache_memory=memory)  # the model's own context length
