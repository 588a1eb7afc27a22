"""AsyncLLM: concurrent streams, streamed text equals the final text, cancellation aborts."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve import SamplingParams
from kvserve.engine.async_llm import AsyncLLM

PROMPTS = ["The history of the printing press", "Ingredients for pancakes:", "def quicksort(arr):"]


@pytest.fixture
def async_llm(smollm2_llm):
    engine = AsyncLLM(lambda: smollm2_llm.engine)
    asyncio.run(engine.started())
    yield engine
    engine.shutdown()


async def _stream(async_llm: AsyncLLM, prompt: str, params: SamplingParams) -> tuple[str, object]:
    pieces, previous, final = [], "", None
    async for output in async_llm.generate(prompt, params):
        text = output.outputs[0].text
        assert text.startswith(previous)  # cumulative text only grows
        pieces.append(text[len(previous):])
        previous, final = text, output
    return "".join(pieces), final


def test_concurrent_streams_equal_offline_results(async_llm, smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=["\n\n"])

    async def main():
        return await asyncio.gather(*(_stream(async_llm, p, params) for p in PROMPTS))

    results = asyncio.run(main())
    async_llm.shutdown()
    offline = smollm2_llm.generate(PROMPTS, params)
    for (streamed, final), reference in zip(results, offline):
        assert final.finished
        assert streamed == final.outputs[0].text == reference.outputs[0].text
        assert final.outputs[0].token_ids == reference.outputs[0].token_ids


def test_cancelled_stream_aborts_and_frees_blocks(async_llm):
    engine = async_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        received = 0
        async for _ in async_llm.generate(PROMPTS[0], params, request_id="cancel-me"):
            received += 1
            if received == 3:
                break  # closing the iterator aborts the request
        for _ in range(200):
            await asyncio.sleep(0.05)
            if not engine.has_unfinished_requests():
                return received
        return received

    assert asyncio.run(main()) == 3
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks


def test_bad_request_raises_in_caller_and_others_continue(async_llm):
    async def main():
        with pytest.raises(ValueError, match="prompt"):
            async for _ in async_llm.generate("", SamplingParams(max_tokens=5)):
                pass
        return await _stream(async_llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5))

    text, final = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 5


def test_the_thread_that_steps_the_engine_also_builds_it(smollm2_llm, monkeypatch):
    """On CPU, building in one thread and stepping in another gives libgomp two thread
    pools and halves decode speed (async_llm's docstring): both must be the worker."""
    engine = smollm2_llm.engine
    threads: dict[str, int] = {}

    def make_engine():
        threads["build"] = threading.get_ident()
        return engine

    step = engine.step

    def recorded_step(*args, **kwargs):
        threads["step"] = threading.get_ident()
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", recorded_step)
    async_llm = AsyncLLM(make_engine)

    async def main():
        assert await async_llm.started() is engine
        return await _stream(async_llm, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))

    try:
        asyncio.run(main())
    finally:
        async_llm.shutdown()
    assert threads["build"] == threads["step"] != threading.get_ident()


def test_a_failed_build_is_raised_by_started():
    def make_engine():
        raise ValueError("no such model: /nowhere")

    async_llm = AsyncLLM(make_engine)
    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(async_llm.started())
    async_llm.shutdown()


def _unsampleable() -> SamplingParams:
    """Parameters the sampler raises on. SamplingParams refuses every such value it is built
    with (tests/test_sampling_params.py), so the row is made by changing a validated object."""
    params = SamplingParams(temperature=1.0, logprobs=2, max_tokens=8)
    params.logprobs = 1.5  # topk() takes no float
    return params


def test_a_request_whose_sampling_raises_fails_alone(async_llm, smollm2_llm):
    engine = async_llm.engine
    # Seeded: the stream beside the failing row must get exactly its tokens from alone.
    good = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)

    async def main():
        stream = async_llm.generate(PROMPTS[0], good)
        first = await anext(stream)  # running: the bad request's first step includes it

        async def rest():
            final = first
            async for final in stream:
                pass
            return final

        good_task = asyncio.create_task(rest())
        with pytest.raises(RuntimeError, match=r"request failed in the engine: TypeError"):
            async for _ in async_llm.generate(PROMPTS[1], _unsampleable()):
                pass
        return await good_task

    beside = asyncio.run(main())
    async_llm.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks
    alone = smollm2_llm.generate(PROMPTS[0], good)[0].outputs[0]
    assert beside.finished and beside.outputs[0].finish_reason == "length"
    assert beside.outputs[0].token_ids == alone.token_ids

    # Offline, both in the same first step: the failed one says why, the other is untouched.
    failed, ok = smollm2_llm.generate([PROMPTS[1], PROMPTS[0]], [_unsampleable(), good])
    assert failed.outputs[0].finish_reason == "error" and "TypeError" in failed.error
    assert ok.error is None and ok.outputs[0].token_ids == alone.token_ids
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks
