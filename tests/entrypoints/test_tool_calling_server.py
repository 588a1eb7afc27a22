"""Tool calling through the real server (started with --tool-call-parser hermes) and the
openai client: "required" and named functions come back as tool_calls whose arguments
validate against the tool's parameters; streamed deltas reassemble to the non-streamed
calls, a long argument arriving in fragments as it is generated; tool messages in the
history reach the prompt; bad tool requests are 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


NOTE = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 1, "maxLength": 12},
    "body": {"type": "string", "minLength": 40, "maxLength": 60}},
    "required": ["title", "body"], "additionalProperties": False}
NOTE_TOOL = {"type": "function", "function": {"name": "write_note", "description": "Save a note",
                                              "parameters": NOTE}}


class Streamed:
    """A streamed reply reassembled the way a client does: content, and each call's name and
    arguments concatenated by index (with the argument fragments kept)."""

    def __init__(self, stream) -> None:
        self.content = ""
        self.finish_reason = None
        self.fragments: dict[int, list[str]] = {}
        self.names: dict[int, str] = {}
        for chunk in stream:
            for choice in chunk.choices:
                self.finish_reason = choice.finish_reason or self.finish_reason
                self.content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    if call.function.name:
                        assert call.index not in self.names and call.id.startswith("call_")
                        self.names[call.index] = call.function.name
                    if call.function.arguments:
                        assert call.index in self.names, "arguments before the call's name"
                        self.fragments.setdefault(call.index, []).append(call.function.arguments)

    @property
    def calls(self) -> list[tuple[str, str]]:
        return [(self.names[i], "".join(self.fragments.get(i, []))) for i in sorted(self.names)]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}},
])
def test_constrained_tool_calls_validate_and_stream_the_same(server, tool_choice):
    client = server.client()
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0.0,
                max_tokens=64, parallel_tool_calls=False)
    reply = client.chat.completions.create(**args)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    streamed = Streamed(client.chat.completions.create(stream=True, **args))
    assert streamed.calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert streamed.finish_reason == "tool_calls"
    assert len(streamed.fragments[0]) >= 2  # the arguments as they are generated


def test_a_long_argument_streams_in_fragments(server):
    client = server.client()
    args = dict(model=MODEL, tools=[NOTE_TOOL, *TOOLS], temperature=0.0, max_tokens=64,
                tool_choice={"type": "function", "function": {"name": "write_note"}},
                messages=[{"role": "user", "content": "Write a note about the shopping for the weekend."}])
    reply = client.chat.completions.create(**args).choices[0]
    assert reply.finish_reason == "tool_calls"
    (call,) = reply.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), NOTE)
    streamed = Streamed(client.chat.completions.create(stream=True, **args))
    assert streamed.calls == [("write_note", call.function.arguments)]
    assert streamed.finish_reason == "tool_calls"
    # Fragments as the tokens come (one each), not the arguments whole at the end.
    assert len(streamed.fragments[0]) >= 10, streamed.fragments[0]


@pytest.mark.slow
def test_required_samples_at_temperature_validate(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.8, seed=5,
        n=2, max_tokens=64, parallel_tool_calls=False)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1


def test_auto_answers_with_content_or_parsed_calls_and_streams_the_same(server):
    client = server.client()
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=32)
    choice = client.chat.completions.create(**args).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
    else:  # what the model wrote was not a well-formed call: it is the content
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    streamed = Streamed(client.chat.completions.create(stream=True, **args))
    assert streamed.calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert streamed.content.strip() == (choice.message.content or "").strip()
    assert streamed.finish_reason == choice.finish_reason


def test_round_trip_with_a_tool_message(server):
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            tool_choice="none", temperature=0.0, max_tokens=8)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(f"{server.base_url}/tokenize", json={"messages": history}, timeout=60).json()
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=60).json()
    assert "Sunny, 21 degrees" in text["prompt"] and "get_weather" in text["prompt"]


@pytest.mark.parametrize("body,param,in_message", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name", "Field required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
])
def test_bad_tool_request_is_a_400(server, body, param, in_message):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and in_message in error["message"], error
