"""Each --tool-call-parser on canned model outputs: the calls it finds (name, arguments as
JSON), the content around them, and text that is not a call left as content. Streaming
deltas, fed the text in pieces of several sizes, reassemble to the parsed result, and a
call's arguments arrive in fragments as they are written."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.tool_parsers import PARSERS, ToolCall
from kvserve.entrypoints.openai.tool_stream import ToolCallDeltas

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
TIME = ToolCall("get_time", json.dumps({"zone": "UTC"}))

CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
         None, [WEATHER]),
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
         '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
         "Let me check.", [WEATHER, TIME]),
        ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', None, [TIME]),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',
         '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', []),
    ],
    "qwen25": [
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', None, [TIME]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None, [WEATHER]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
         '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [WEATHER, TIME]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
         '{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [WEATHER, TIME]),
        ("Sure. [TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}]", "Sure.", [TIME]),
        ("No tools needed.", "No tools needed.", []),
    ],
}
PARAMS = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("parser,text,content,calls", PARAMS)
def test_parse(parser, text, content, calls):
    parsed = PARSERS[parser]().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls]


def _request(**kwargs) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": c.name, "parameters": {"type": "object"}}}
             for c in (WEATHER, TIME)]
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, **kwargs)


def _reassemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            if "id" in call:
                assert call["id"].startswith("call_") and call["function"]["arguments"] == ""
                entry[0] = call["function"]["name"]  # the name comes first, alone
            entry[1] += call["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _stream(deltas: ToolCallDeltas, text: str, step: int = 3) -> list[dict]:
    out = []
    for end in range(step, len(text) + step, step):
        out += deltas.update(text[:end], finished=end >= len(text))
    return out


def _argument_fragments(deltas: list[dict], index: int) -> list[str]:
    return [call["function"]["arguments"] for delta in deltas for call in delta.get("tool_calls", [])
            if call["index"] == index and call["function"]["arguments"]]


WELL_FORMED = [case for case in PARAMS if case[3] or "<tool_call>" not in case[1]]


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("parser,text,content,calls", WELL_FORMED)
def test_streamed_auto_deltas_reassemble(parser, text, content, calls, step):
    deltas = _stream(ToolCallDeltas(_request(), "auto", parser), text, step)
    streamed_content, streamed_calls = _reassemble(deltas)
    assert streamed_calls == [(c.name, c.arguments) for c in PARSERS[parser]().parse(text).tool_calls]
    assert [(name, json.loads(arguments)) for name, arguments in streamed_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls]
    if calls:
        assert streamed_content.strip() == (content or "")
    else:
        assert streamed_content == text


def test_streamed_auto_call_that_breaks_off_was_streamed_as_written():
    """A call is streamed from its name on; JSON that then breaks off ends it where it broke
    (the whole reply parsed at once is content)."""
    text = 'I will look.<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>'
    assert _reassemble(_stream(ToolCallDeltas(_request(), "auto", "hermes"), text)) == (
        "I will look.", [("get_time", '{"zone": ')])
    assert PARSERS["hermes"]().parse(text).tool_calls == []


@pytest.mark.parametrize("parser,template", [
    ("hermes", 'Sure.<tool_call>\n{{"name": "write_note", "arguments": {}}}\n</tool_call>'),
    ("llama3_json", '{{"name": "write_note", "parameters": {}}}'),
    ("mistral", '[TOOL_CALLS] [{{"name": "write_note", "arguments": {}}}]'),
])
def test_long_arguments_stream_in_fragments_as_written(parser, template):
    arguments = json.dumps({"title": "Groceries", "body": "eggs, milk, bread, " * 6, "tags": ["home", "list"]})
    text = template.format(arguments)
    deltas = ToolCallDeltas(_request(), "auto", parser)
    out = []
    for end in range(4, len(text) + 4, 4):  # a token of about four characters at a time
        new = deltas.update(text[:end], finished=end >= len(text))
        if end < len(text) - len(arguments) and any("tool_calls" in d for d in new):
            assert ("write_note" in text[:end]), "a call starts only once its name is written"
        out += new
    fragments = _argument_fragments(out, 0)
    assert len(fragments) > len(arguments) // 8 and "".join(fragments) == arguments
    assert _reassemble(out)[1] == [("write_note", arguments)]


def test_streamed_named_and_required_deltas():
    named = _request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    arguments = '{"zone": "UTC"}'
    assert _reassemble(_stream(ToolCallDeltas(named, "named", None), arguments)) == (
        "", [("get_time", arguments)])
    required = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    deltas = _stream(ToolCallDeltas(_request(), "required", None), required, step=2)
    assert _reassemble(deltas) == ("", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    assert len(_argument_fragments(deltas, 0)) >= 5  # the first call's arguments as written


def test_required_output_with_whitespace_keeps_the_arguments_as_written():
    """The grammar lets the model put whitespace between tokens; the arguments are the
    object's own text, and json reads them as the array's element."""
    required = '[ {"name" : "get_weather" ,\n "parameters" : { "city" : "Paris" , "unit" : "C" } } ]'
    streamed = _reassemble(_stream(ToolCallDeltas(_request(), "required", None), required))
    assert streamed == ("", [("get_weather", '{ "city" : "Paris" , "unit" : "C" }')])
    assert json.loads(streamed[1][0][1]) == json.loads(required)[0]["parameters"]
