"""Overlapped scheduling (decode step N+1 launched before the host reads step N's tokens)
produces exactly what one-step-at-a-time scheduling produces, on the real model.

On CPU the overlap buys no time (the model runs in the host thread), but the bookkeeping
is the same as on a GPU: inputs taken from the device tensor of the step before, the extra
token of a sequence that a stop ended dropped, no KV slot beyond the length limit, aborts
and admissions in between.
"""

from __future__ import annotations

import json
import re

import jsonschema

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.structured_output.params import StructuredOutputsParams
from tests.quantization.prompts import CONTINUATIONS as PROMPTS


def _params() -> list[SamplingParams]:
    """Greedy, seeded sampling, stops of every kind, limits, n > 1, and settings that must
    fall back to one step at a time (penalties, logprobs, min_tokens)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=24),  # may end at EOS
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=21,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, stop=["\n"], ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, min_tokens=5,
                       ignore_eos=True),
    ]


def _run(llm: LLM) -> dict[str, list]:
    """Starts four requests, steps, then adds two more while the others decode."""
    engine: LLMEngine = llm.engine
    params = _params()
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], params[i])
    finals: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = [
                    (c.token_ids, c.text, c.finish_reason,
                     None if c.logprobs is None else [sorted(entry) for entry in c.logprobs])
                    for c in output.outputs
                ]
        steps += 1
        if steps == 6:
            for i in (4, 5):
                engine.add_request(f"r{i}", PROMPTS[i], params[i])
    return finals


def test_overlapped_outputs_equal_one_step_at_a_time(smollm2_loaded):
    """Same tokens, text, finish reasons and logprob ids (the values differ in the last
    bits: batches are composed differently)."""
    reference = _run(LLM(loaded=smollm2_loaded, kv_cache_memory="128MiB", max_model_len=2048))
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="128MiB", max_model_len=2048, overlap_scheduling=True)
    overlapped = _run(llm)
    assert overlapped == reference
    assert llm.engine.core.num_steps_ahead >= 10  # it did overlap
    # Every block is back in the pool: no step ahead left one behind.
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.runner.num_blocks


def test_overlap_stops_at_the_length_limit(smollm2_loaded):
    """A sequence reaching max_model_len is not run ahead past it."""
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=24,
              overlap_scheduling=True)
    prompt = llm.engine.tokenizer(PROMPTS[0]).input_ids
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == 24
    assert out.outputs[0].finish_reason == "length"
    reference = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=24)
    expected = reference.generate({"prompt_token_ids": prompt},
                                  SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_abort_while_a_step_is_in_flight(smollm2_loaded):
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=1024, overlap_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", PROMPTS[1], params)
    for _ in range(8):
        engine.step()
    assert engine.core._inflight is not None
    aborted = engine.abort_request("drop")
    assert aborted.outputs[0].finish_reason == "abort"
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["keep"]
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks
    reference = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=1024)
    expected = reference.generate(PROMPTS[0], params)[0]
    assert finals[0].outputs[0].token_ids == expected.outputs[0].token_ids


def test_constrained_steps_run_ahead_with_the_same_tokens(smollm2_loaded):
    """Grammar-constrained sequences decode overlapped too (each launched step's masks see
    the token of the step still in flight): same tokens as one step at a time, valid output,
    and the matcher of a sequence ended by its grammar is never asked for another mask."""
    schema = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.9, seed=5, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}-\d{2}")),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
        SamplingParams(temperature=0.0, max_tokens=4),  # unconstrained beside them, done early
    ]
    prompts = [f"Describe person {i} as JSON:" for i in range(len(params))]
    reference = LLM(loaded=smollm2_loaded, kv_cache_memory="128MiB", max_model_len=1024)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="128MiB", max_model_len=1024, overlap_scheduling=True)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.core.num_steps_ahead >= 10
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), schema)
    jsonschema.validate(json.loads(outputs[1].outputs[0].text), schema)
    assert re.fullmatch(r"[a-z]{3,8}-\d{2}", outputs[2].outputs[0].text)
    assert outputs[3].outputs[0].text.startswith(("alpha", "beta"))
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.runner.num_blocks
