"""The engine core in its own process (multiprocess_engine_core): the same outputs as the
in-process core, aborts reach it, and its failures surface in the front instead of hanging."""

from __future__ import annotations

import os
import signal

import pytest

from kvserve import LLM, SamplingParams
from tests.polling import wait_for

ENGINE_KWARGS = dict(kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=64)
PROMPTS = ["The history of the printing press", "Ingredients for pancakes:", "def quicksort(arr):"]


@pytest.fixture(scope="module")
def process_llm():
    llm = LLM(multiprocess_engine_core=True, **ENGINE_KWARGS)
    yield llm
    llm.engine.shutdown()


def _summary(outputs):
    return [[(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in out.outputs]
            for out in outputs]


def _logprobs(outputs):
    """Every logprob, flat: the core process may batch the requests differently (they reach
    it one by one), which moves fp32 sums in the last bits."""
    values = []
    for out in outputs:
        for entry in out.prompt_logprobs or []:
            values += [] if entry is None else sorted(entry.items())
        for c in out.outputs:
            for entry in c.logprobs or []:
                values += sorted(entry.items())
    return values


def test_outputs_equal_the_in_process_core(process_llm):
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop=["\n\n", "."]),
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=16, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, stop_token_ids=[28]),
    ]
    reference = LLM(**ENGINE_KWARGS)
    expected = reference.generate(PROMPTS, params)
    assert process_llm.engine.core is None  # nothing of the core lives in this process
    got = process_llm.generate(PROMPTS, params)
    assert _summary(got) == _summary(expected)
    got_logprobs, expected_logprobs = _logprobs(got), _logprobs(expected)
    assert [token for token, _ in got_logprobs] == [token for token, _ in expected_logprobs]
    assert [value for _, value in got_logprobs] == pytest.approx([value for _, value in expected_logprobs], abs=1e-4)
    assert any(c.finish_reason == "stop" for out in got for c in out.outputs)
    assert all(out.metrics.first_scheduled_time is not None for out in got)


def test_abort_frees_the_core(process_llm):
    engine = process_llm.engine
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    while not any(c.token_ids for out in engine.step() for c in out.outputs):
        pass
    assert engine.stats().num_running_seqs == 1 and engine.stats().kv_cache_usage > 0
    final = engine.abort_request("long")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    # The core reports its state once it has taken the abort, with no step to carry it.
    assert wait_for(lambda: engine.stats().num_running_seqs == 0 and engine.stats().kv_cache_usage == 0,
                    timeout=10)


def test_a_failed_load_raises_in_the_front(tmp_path):
    with pytest.raises(Exception, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"), multiprocess_engine_core=True)


def test_a_dead_core_fails_the_step_instead_of_hanging():
    llm = LLM(multiprocess_engine_core=True, **ENGINE_KWARGS)
    engine = llm.engine
    os.kill(engine.client._process.pid, signal.SIGKILL)
    engine.add_request("orphan", PROMPTS[1], SamplingParams(max_tokens=8))
    with pytest.raises(RuntimeError, match="engine core process"):
        engine.step()
