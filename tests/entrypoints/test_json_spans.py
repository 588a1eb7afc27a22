"""JsonSpans against the json module: every recorded value's text is that value, every value
within the depth is recorded, values only grow as the text does, and text that is not JSON
stops the scan."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.json_spans import JsonSpans

DOCUMENTS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}',
    ' [ {"name" : "a\\"}]{" ,\n "parameters" : {"x": [1, -2.5e3, true, false, null], "y": {}}} , {"name": "b", '
    '"parameters": {"s": "\\u00e9\\\\", "e": []}} ] ',
    '{"a": {"b": {"c": [1, {"d": 2}]}}, "": 0, "k\\n": "v"}',
    "[]",
    "{}",
    '"just a string"',
    '[[], [[]], {"x": [{}]}]',
]


def _reference_paths(value, path=(), max_depth=2):
    yield path, value
    if len(path) == max_depth:
        return
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _reference_paths(child, (*path, key), max_depth)


def _scan(text: str, step: int) -> JsonSpans:
    spans = JsonSpans()
    for end in range(step, len(text) + step, step):
        spans.feed(text[:end])
    return spans


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize("text", DOCUMENTS)
def test_recorded_values_are_the_documents_values(text, step):
    spans = _scan(text, step)
    assert spans.done and not spans.invalid
    assert spans.end == len(text.rstrip())
    reference = dict(_reference_paths(json.loads(text)))
    assert set(spans.spans) == set(reference)
    for path, value in reference.items():
        assert json.loads(spans.value(text, path)) == value, path


@pytest.mark.parametrize("text", DOCUMENTS)
def test_values_only_grow(text):
    spans, seen = JsonSpans(), {}
    for end in range(1, len(text) + 1):
        spans.feed(text[:end])
        for path in spans.spans:
            value = spans.value(text[:end], path)
            assert value.startswith(seen.get(path, "")), (path, value)
            seen[path] = value


def test_the_scan_starts_where_asked_and_stops_after_the_value():
    text = 'Sure: <tool_call> {"name": "x"} </tool_call> {"more": 1}'
    spans = JsonSpans(text.index(">") + 1)
    spans.feed(text)
    assert spans.done and text[spans.end - 1] == "}" and spans.value(text, ()) == '{"name": "x"}'
    assert ("more",) not in spans.spans


@pytest.mark.parametrize("text,readable", [
    ('{"zone": </tool_call>', '{"zone": '),
    ('{"a": 1,}', '{"a": 1,'),
    ("[1, 2,]", "[1, 2,"),
    ('{"a" 1}', '{"a" '),
    ("{'a': 1}", "{"),
    ('{"a": tru e}', '{"a": tru '),
    ('{"a": 1x}', '{"a": 1'),
])
def test_text_that_is_not_json_stops_the_scan(text, readable):
    spans = _scan(text, 1)
    assert spans.invalid and not spans.done
    assert spans.value(text, ()) == readable
