"""Requests for different adapters and the base model in one batch get exactly what each
gets alone: with chunked prefill, preemption, prefix-cache hits, and more adapters than
device slots (a request waits for a slot; adapters are evicted from the host cache)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import load_model
from tests.lora.tiny_model import random_prompt, save_adapters, save_tiny_llama

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_with_adapters(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(str(directory / "model"))
    return str(directory / "model"), save_adapters(base, str(directory), [4, 8, 16])


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def test_mixed_batch_equals_each_request_alone(tiny_with_adapters) -> None:
    model_dir, adapters = tiny_with_adapters
    shared_prefix = random_prompt(12, seed=99)
    prompts, loras = [], []
    for i in range(8):
        lora = None if i % 4 == 3 else adapters[i % 3]
        # Half the prompts share a 12-token prefix (3 blocks): hits for a repeated adapter only.
        prompt = (shared_prefix if i % 2 else []) + random_prompt(5 + 3 * i, seed=i)
        prompts.append({"prompt_token_ids": prompt})
        loras.append(lora)

    alone_llm = LLM(loaded=load_model(model_dir, dtype=torch.float32), enable_lora=True, kv_cache_memory="16MiB",
                    block_size=4, enable_prefix_caching=False)
    alone = [alone_llm.generate(prompt, greedy(), lora_request=lora)[0].outputs[0]
             for prompt, lora in zip(prompts, loras)]

    # Two slots for three adapters, 20-token steps (prefills in chunks), and a cache of 24
    # blocks of 4 tokens, too small for all eight requests at once: preemptions follow.
    mixed_llm = LLM(loaded=load_model(model_dir, dtype=torch.float32), enable_lora=True, max_loras=2,
                    max_cpu_loras=2, kv_cache_memory=str(24 * 4 * 2 * 2 * 2 * 16 * 4), block_size=4,
                    max_num_batched_tokens=20, max_model_len=96)
    mixed = [output.outputs[0] for output in mixed_llm.generate(prompts, greedy(), lora_request=loras)]
    stats = mixed_llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    runner = mixed_llm.engine.core.runner
    assert runner.lora.num_disk_loads > len(adapters)  # the host cache held two of three

    for i, (one, together) in enumerate(zip(alone, mixed)):
        assert together.token_ids == one.token_ids, i
        for step, (a, b) in enumerate(zip(one.logprobs, together.logprobs)):
            assert a.keys() == b.keys()
            for token_id in a:
                assert b[token_id] == pytest.approx(a[token_id], abs=1e-4), (i, step)
    # The adapters change the outputs (so the comparison above can fail).
    assert len({tuple(output.token_ids) for output in alone[:3]}) == 3


def test_prefix_cache_is_per_adapter(tiny_with_adapters) -> None:
    """The same prompt under another adapter (or the base) finds no cached block; under the
    same adapter it does, and gets the same output as computed afresh."""
    model_dir, adapters = tiny_with_adapters
    llm = LLM(loaded=load_model(model_dir, dtype=torch.float32), enable_lora=True, kv_cache_memory="16MiB",
              block_size=4)
    prompt = {"prompt_token_ids": random_prompt(17, seed=7)}

    def hits_of(lora) -> tuple[int, list[int]]:
        before = llm.engine.stats().prefix_cache_hits
        output = llm.generate(prompt, greedy(4), lora_request=lora)[0].outputs[0]
        return llm.engine.stats().prefix_cache_hits - before, output.token_ids

    first_hits, first = hits_of(adapters[0])
    assert first_hits == 0
    assert hits_of(adapters[1])[0] == 0
    assert hits_of(None)[0] == 0
    again_hits, again = hits_of(adapters[0])
    assert again_hits == 16 and again == first


def test_running_and_waiting_requests_per_adapter(tiny_with_adapters) -> None:
    model_dir, adapters = tiny_with_adapters
    llm = LLM(loaded=load_model(model_dir, dtype=torch.float32), enable_lora=True, max_loras=1,
              kv_cache_memory="16MiB", block_size=4)
    engine = llm.engine
    for lora in (adapters[0], adapters[1], adapters[0], None):
        engine.add_request(None, {"prompt_token_ids": random_prompt(6, seed=1)}, greedy(3), lora_request=lora)
    assert engine.stats().lora_requests == {"adapter1": (0, 2), "adapter2": (0, 1)}
    engine.step()
    # One slot: adapter2's request waits until adapter1's have finished; the base one runs.
    assert engine.stats().lora_requests == {"adapter1": (2, 0), "adapter2": (0, 1)}
    assert engine.stats().num_running_reqs == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().lora_requests == {}


def test_requests_running_on_a_removed_adapter_finish_on_it(tiny_with_adapters) -> None:
    model_dir, adapters = tiny_with_adapters
    llm = LLM(loaded=load_model(model_dir, dtype=torch.float32), enable_lora=True, kv_cache_memory="16MiB",
              block_size=4)
    prompt = {"prompt_token_ids": random_prompt(10, seed=3)}
    expected = llm.generate(prompt, greedy(), lora_request=adapters[2])[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("running", prompt, greedy(), lora_request=adapters[2])
    engine.step()
    engine.remove_lora(adapters[2].lora_int_id)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].token_ids for o in outputs if o.finished] == [expected]
    # Asked for again, it is read from disk again.
    assert llm.generate(prompt, greedy(), lora_request=adapters[2])[0].outputs[0].token_ids == expected


def test_decode_logprobs_do_not_depend_on_the_batch(tiny_with_adapters) -> None:
    """Bit for bit: on CPU each token runs through its own slot's matrices in the same order
    whatever else is in the step (kvserve's lora_add_ kernel), as the fp32 base linears do up
    to 16 rows; 4 prompts of 4 tokens keep every step within that."""
    model_dir, adapters = tiny_with_adapters
    llm = LLM(loaded=load_model(model_dir, dtype=torch.float32), enable_lora=True, kv_cache_memory="16MiB",
              block_size=4, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": random_prompt(4, seed=20 + i)} for i in range(4)]
    loras = [adapters[0], adapters[1], None, adapters[0]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    alone = [llm.generate(prompt, params, lora_request=lora)[0].outputs[0] for prompt, lora in zip(prompts, loras)]
    together = [output.outputs[0] for output in llm.generate(prompts, params, lora_request=loras)]
    for one, batched in zip(alone, together):
        assert batched.token_ids == one.token_ids
        assert batched.logprobs == one.logprobs


def test_rows_past_the_step_go_back_to_the_base_model(tiny_with_adapters) -> None:
    """After a step of many tokens on an adapter, a shorter step leaves no adapter on the
    rows past it (a CUDA graph's padding rows read them)."""
    model_dir, adapters = tiny_with_adapters
    llm = LLM(loaded=load_model(model_dir, dtype=torch.float32), enable_lora=True, kv_cache_memory="16MiB")
    llm.generate({"prompt_token_ids": random_prompt(5, seed=1)}, greedy(2), lora_request=adapters[0])
    slots = llm.engine.core.runner.lora
    slot = slots.slot_of(adapters[0].lora_int_id)
    slots.set_tokens([adapters[0].lora_int_id, 0], [6, 2])
    assert slots.token_slots[:8].tolist() == [slot] * 6 + [-1] * 2
    slots.set_tokens([adapters[0].lora_int_id], [3])
    assert slots.token_slots[:10].tolist() == [slot] * 3 + [-1] * 7
