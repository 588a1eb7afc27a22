"""A constraint is checked before anything runs: exactly one kind, the right types, and
content that compiles; a bad one is a ValueError naming the field."""

from __future__ import annotations

import json

import pytest

from kvserve import SamplingParams
from kvserve.structured_output import grammar
from kvserve.structured_output.params import StructuredOutputsParams


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list"),
    ({"regex": 5}, "regex must be a string"),
    ({"json": {"x": {1, 2}}}, "not JSON-serialisable"),
    ({"json_object": "yes"}, "json_object must be true"),
])
def test_malformed_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_equal_schemas_share_a_key_and_property_order_is_kept():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
              "required": ["b", "a"]}
    a = StructuredOutputsParams(json=schema)
    assert a.key == StructuredOutputsParams(json=dict(schema)).key
    assert a.key != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key
    # The output writes properties in the schema's order, as OpenAI's does: "b" before "a".
    assert list(json.loads(a.json)["properties"]) == ["b", "a"]
    reordered = {**schema, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert StructuredOutputsParams(json=reordered).key != a.key


def test_sampling_params_reads_a_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regexp": "a"})


@pytest.mark.parametrize("kwargs,kind", [
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "a{2,1}"}, "regex"),
    ({"grammar": "root ::= missing_rule"}, "grammar"),
    ({"grammar": "not a grammar"}, "grammar"),
    ({"json": "{not json"}, "json"),
    ({"json": "[1, 2]"}, "json"),
    ({"json": {"type": "no-such-type"}}, "json"),
    ({"json": {"type": "array", "items": {"not": {"type": "string"}}}}, "json"),
    ({"json": {"type": "array", "uniqueItems": True}}, "json"),
    ({"json": {"type": "number", "multipleOf": 0.5}}, "json"),
])
def test_content_that_does_not_compile(kwargs, kind):
    with pytest.raises(grammar.GrammarError, match=f"structured_outputs.{kind} ") as error:
        grammar.check(StructuredOutputsParams(**kwargs))
    assert error.value.kind == kind


@pytest.mark.parametrize("kwargs", [
    {"regex": "[0-9]{3}"}, {"choice": ['say "hi"', "back\\slash", "new\nline"]},
    {"grammar": 'root ::= "a" root | "b"'}, {"json": {"type": "object"}}, {"json_object": True},
    {"json": {"type": "integer", "multipleOf": 5}}, {"json": {"enum": [{"not": 1}]}},
])
def test_content_that_compiles(kwargs):
    grammar.check(StructuredOutputsParams(**kwargs))
