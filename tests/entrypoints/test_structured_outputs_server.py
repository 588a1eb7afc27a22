"""Structured outputs through the real server and the openai client: response_format
(json_schema, json_object, text) and vLLM's structured_outputs extra on both endpoints,
checked with jsonschema and re.fullmatch; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.structured_output.schemas import SCHEMAS

MODEL = "SmolLM2-135M-Instruct"
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


def _ask_for(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON following this schema: {json.dumps(schema)}"}]


def _schema_reply(client: openai.OpenAI, index: int, schema: dict):
    return client.chat.completions.create(
        model=MODEL, messages=_ask_for(schema), temperature=0.7, seed=index, max_tokens=160,
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"schema_{index}", "schema": schema, "strict": True}},
    )


def _check_schemas(server, schemas: list[dict]) -> None:
    client = server.client()
    with ThreadPoolExecutor(len(schemas)) as pool:  # one batch in the engine
        replies = list(pool.map(lambda item: _schema_reply(client, *item), enumerate(schemas)))
    for schema, reply in zip(schemas, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schemas_validate(server):
    _check_schemas(server, SCHEMAS[10:14])


@pytest.mark.slow
def test_all_json_schemas_validate(server):
    _check_schemas(server, SCHEMAS)


def test_json_object_parses_and_text_is_plain(server):
    client = server.client()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'A dog as JSON, like {"name": "Rex"}.'}],
        n=2, seed=4, temperature=0.7, max_tokens=96, response_format={"type": "json_object"})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)
    plain = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0.0, max_tokens=8)
    text = client.chat.completions.create(**plain, response_format={"type": "text"})
    assert text.choices[0].message.content == client.chat.completions.create(**plain).choices[0].message.content


def test_structured_outputs_extra_on_completions(server):
    client = server.client()
    reply = client.completions.create(
        model=MODEL, prompt="Today's date:", n=3, temperature=1.0, seed=2, max_tokens=20,
        extra_body={"structured_outputs": {"regex": DATE}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(DATE, choice.text), choice.text
    choices = ["cat", "dog", "bird"]
    reply = client.completions.create(
        model=MODEL, prompt=["Pet:", "Animal:"], temperature=1.0, seed=3, max_tokens=8,
        extra_body={"structured_outputs": {"choice": choices}})
    assert [c.text in choices for c in reply.choices] == [True, True]


def test_structured_outputs_extra_on_chat_streams(server):
    grammar = 'root ::= "(" digits ", " digits ")"\ndigits ::= [0-9] [0-9]?'
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A point:"}], temperature=0.7, seed=1,
        max_tokens=16, stream=True, extra_body={"structured_outputs": {"grammar": grammar}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert re.fullmatch(r"\([0-9]{1,2}, [0-9]{1,2}\)", text), text


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body,param,in_message", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs",
     "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     "structured_outputs", "both"),
])
def test_bad_constraint_is_a_400_naming_the_field(server, body, param, in_message):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"messages": CHAT, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert in_message in error["message"]
    ok = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                    json={"prompt": "x", "max_tokens": 2, "structured_outputs": {"choice": ["a"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "a"
