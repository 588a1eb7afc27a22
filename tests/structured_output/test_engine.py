"""Constrained decoding on the real SmolLM2, offline: every sample of every kind of
constraint satisfies it (checked with jsonschema, re.fullmatch, Python's own parser), with
n > 1, forced preemption and speculative decoding; unconstrained requests beside
constrained ones get the tokens they get alone."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.model_executor.model_runner import kv_cache_bytes_per_block
from kvserve.structured_output.params import StructuredOutputsParams
from tests.structured_output.schemas import SCHEMAS

# Bounded (at most three terms), so that every sample ends within max_tokens.
ARITHMETIC = r"""
root ::= term (op term)? (op term)?
term ::= number | "(" number op number ")"
op ::= "+" | "-" | "*" | "/"
number ::= [1-9] [0-9]?
"""
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["Paris", "London", "New York", "Tokyo"]


def _is_arithmetic(text: str) -> bool:
    """Python parses it as integers combined by + - * / and nothing else."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree)) and not re.search(r"\s", text)


def _json_prompt(schema: dict) -> str:
    return f"Write a JSON value that follows this JSON schema: {json.dumps(schema)}\nJSON:"


def _sampled(structured: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.7, "seed": 0, "max_tokens": 96, **kwargs},
                          structured_outputs=structured)


@pytest.fixture(scope="module")
def llm(smollm2_loaded) -> LLM:
    return LLM(loaded=smollm2_loaded, kv_cache_memory="128MiB", max_model_len=1024)


def test_json_schemas_validate(llm):
    schemas = SCHEMAS[:8]
    outputs = llm.generate(
        [_json_prompt(s) for s in schemas],
        [_sampled(StructuredOutputsParams(json=s), seed=i) for i, s in enumerate(schemas)],
    )
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("structured,holds", [
    (StructuredOutputsParams(regex=DATE), lambda text: re.fullmatch(DATE, text)),
    (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    (StructuredOutputsParams(grammar=ARITHMETIC), _is_arithmetic),
])
def test_every_sample_holds(llm, structured, holds):
    params = _sampled(structured, n=4, seed=3, temperature=1.0, max_tokens=48)
    outputs = llm.generate(["The answer is:", "Give an example:"], [params, params])
    texts = [c.text for o in outputs for c in o.outputs]
    assert len(texts) == 8
    for completion in (c for o in outputs for c in o.outputs):
        assert completion.finish_reason == "stop", completion.text
        assert holds(completion.text), completion.text
    assert len(set(texts)) > 1  # the samples differ: each followed its own matcher


def test_grammar_that_cannot_end_finishes_with_length(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(regex="a{40}"))
    (output,) = llm.generate("Letters:", params)
    completion = output.outputs[0]
    assert completion.finish_reason == "length"
    assert re.fullmatch("a+", completion.text)


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    constrained = [
        _sampled(StructuredOutputsParams(json=SCHEMAS[0]), n=2, max_tokens=32),
        _sampled(StructuredOutputsParams(regex=DATE), temperature=0.0),
    ]
    outputs = llm.generate([prompts[0], prompts[1], *prompts],
                           [*constrained, greedy, greedy, greedy])
    assert [list(o.outputs[0].token_ids) for o in outputs[2:]] == alone


def test_bad_constraint_is_refused_before_queueing(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=2), bad])
    assert not llm.engine.core.has_unfinished_requests()
    assert llm.generate("next", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_grammar_compiled_once_per_content(smollm2_loaded):
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=1024)
    params = [SamplingParams(temperature=0.0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
              for _ in range(3)]
    llm.generate(["a", "b", "c"], params)
    llm.generate("d", params[0])
    assert llm.engine.core.runner.step_sampler.grammars.compiler.num_cached == 1


SPEC_PROMPT = (
    'Record: {"name": "Ann", "age": 31}\nRecord: {"name": "Bob", "age": 45}\n'
    'Record: {"name": "Ann", "age": 31}\nRecord:'
)
DATES_PROMPT = "Dates: 2021-03-04, 1999-12-31, 2021-03-04, 1999-12-31, 2021-03-04,"


def _greedy_constrained(llm: LLM) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[0])),
        SamplingParams(temperature=0.0, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(regex=DATE)),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    outputs = llm.generate([SPEC_PROMPT, DATES_PROMPT, SPEC_PROMPT], params)
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), SCHEMAS[0])
    assert re.fullmatch(DATE, outputs[1].outputs[0].text), outputs[1].outputs[0].text
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def greedy_plain(llm) -> list[list[int]]:
    return _greedy_constrained(llm)


def test_speculative_decoding_keeps_greedy_constrained_output(smollm2_loaded, greedy_plain):
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert _greedy_constrained(llm) == greedy_plain
    stats = llm.engine.spec_decode_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_jump_forward_keeps_greedy_constrained_output(smollm2_loaded, greedy_plain):
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=1024,
              speculative_config={"method": "jump_forward", "num_speculative_tokens": 8})
    assert _greedy_constrained(llm) == greedy_plain
    # The forced text (the schema's keys, the date's dashes) was drafted and held.
    assert llm.engine.spec_decode_stats.num_accepted_tokens > 0


NUMBERS = StructuredOutputsParams(
    json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": 6, "maxItems": 6}, disable_any_whitespace=True)
NUMBER_PROMPTS = ["Six primes:", "Six evens:", "Six years:"]


def _numbers(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=NUMBERS)
    outputs = llm.generate(NUMBER_PROMPTS, params)
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), json.loads(NUMBERS.json))
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_preemption_keeps_greedy_constrained_output(smollm2_loaded, llm):
    block_size = 8
    num_blocks = 6  # one request fits, all three at once do not
    small = LLM(loaded=smollm2_loaded, block_size=block_size, enable_prefix_caching=False,
                max_model_len=num_blocks * block_size,
                kv_cache_memory=str(num_blocks * kv_cache_bytes_per_block(smollm2_loaded.config, block_size)))
    assert _numbers(small) == _numbers(llm)
    assert small.engine.core.scheduler.num_preemptions > 0
