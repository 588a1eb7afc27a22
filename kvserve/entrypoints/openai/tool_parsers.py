"""Tool calls in a model's text (tool_choice "auto"), one parser per model family, chosen by
--tool-call-parser. Text that does not hold a well-formed call is content, as written.

A parser reads the text as it grows (`calls`, for streaming: a call's name as soon as it is
written, its arguments as far as they are) and as a whole (`parse`); both find the calls
the same way, so what is streamed adds up to what is parsed. A call's arguments are the
JSON object as the model wrote it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.entrypoints.openai.json_spans import JsonSpans, Path


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ParsedOutput:
    content: str | None  # the text outside the calls (None when there is none)
    tool_calls: list[ToolCall]


@dataclass
class CallSoFar:
    """A call as far as the text shows it."""

    name: str | None  # once its string is complete
    arguments: str  # the arguments object as written so far
    complete: bool  # the call's JSON has ended

    def finished_call(self) -> ToolCall | None:
        """The call, if it is complete and well formed."""
        if not self.complete or self.name is None:
            return None
        try:
            is_object = isinstance(json.loads(self.arguments), dict)
        except json.JSONDecodeError:
            is_object = False
        return ToolCall(self.name, self.arguments) if is_object else None


def call_so_far(spans: JsonSpans, text: str, path: Path, arguments_keys: tuple[str, ...]) -> CallSoFar | None:
    """The call whose JSON object is at `path` (None if the value there is not an object)."""
    if not spans.value(text, path).startswith("{"):
        return None
    complete = spans.spans[path].end is not None
    name = spans.spans.get((*path, "name"))
    name_text = None if name is None or name.end is None else text[name.start:name.end]
    key = next((key for key in arguments_keys if (*path, key) in spans.spans), None)
    if key is None:  # a call without arguments takes none
        return CallSoFar(_string(name_text), "{}" if complete else "", complete)
    arguments = spans.value(text, (*path, key))
    if arguments.startswith('"'):  # some models write the arguments as JSON text in a string
        done = spans.spans[(*path, key)].end is not None
        arguments = (_string(arguments) or "") if done else ""
    elif not arguments.startswith("{"):
        arguments = ""
    return CallSoFar(_string(name_text), arguments, complete)


def array_calls(spans: JsonSpans, text: str, arguments_keys: tuple[str, ...]) -> list[CallSoFar]:
    """The calls of a JSON array of call objects, in order, up to the first that is not one."""
    calls = []
    while (len(calls),) in spans.spans:
        call = call_so_far(spans, text, (len(calls),), arguments_keys)
        if call is None:
            break
        calls.append(call)
    return calls


def num_elements(spans: JsonSpans) -> int:
    """How many elements the root array has so far."""
    return sum(1 for path in spans.spans if len(path) == 1)


def finished_calls(calls: list[CallSoFar]) -> list[ToolCall] | None:
    """All the calls, when there is at least one and each is complete and well formed."""
    finished = [call.finished_call() for call in calls]
    return finished if finished and None not in finished else None


def _string(text: str | None) -> str | None:
    if text is None or not text.startswith('"'):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


def _before_marker(text: str, marker: str) -> int:
    """How much of `text` is certainly content: all before the marker, or before a tail that
    may be the marker's beginning."""
    found = text.find(marker)
    if found >= 0:
        return found
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes,
    Qwen2.5 and most models trained on their chat templates); a last block the model ended
    without closing still counts."""

    start = "<tool_call>"

    def __init__(self) -> None:
        self._blocks: list[JsonSpans] = []  # the JSON after each start marker

    def content_prefix(self, text: str) -> int:
        """Streaming: the length of the text's start that is certainly not a call."""
        return _before_marker(text, self.start)

    def calls(self, text: str) -> list[CallSoFar]:
        while True:
            if self._blocks:
                self._blocks[-1].feed(text)
                if not self._blocks[-1].done:
                    break
            found = text.find(self.start, self._blocks[-1].end if self._blocks else 0)
            if found < 0:
                break
            self._blocks.append(JsonSpans(found + len(self.start)))
        calls = []
        for block in self._blocks:
            call = call_so_far(block, text, (), ("arguments",))
            if call is None:
                break
            calls.append(call)
        return calls

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(self.start)
        calls = self.calls(text)
        finished = finished_calls(calls) if len(calls) == len(self._blocks) else None
        if first < 0 or finished is None:
            return ParsedOutput(text, [])
        return ParsedOutput(_content(text[:first]), finished)


class Llama3JsonParser:
    """Llama 3.x's JSON calls: `{"name": ..., "parameters": {...}}`, several separated by
    `;`, optionally after `<|python_tag|>`; the whole output is calls or none is."""

    _python_tag = "<|python_tag|>"
    _arguments_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        self._values: list[JsonSpans] = []

    def content_prefix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self._python_tag.startswith(stripped[:len(self._python_tag)]):
            return 0
        return len(text)

    def calls(self, text: str) -> list[CallSoFar]:
        while True:
            if self._values:
                self._values[-1].feed(text)
                if not self._values[-1].done:
                    break
            start = self._next_value(text)
            if start is None:
                break
            self._values.append(JsonSpans(start))
        calls = []
        for value in self._values:
            call = call_so_far(value, text, (), self._arguments_keys)
            if call is None:
                break
            calls.append(call)
        return calls

    def _next_value(self, text: str) -> int | None:
        """Where the next value starts: after the python tag, or after the last value and
        its `;` (None until it has begun)."""
        if not self._values:
            position = len(text) - len(text.lstrip())
            if text.startswith(self._python_tag, position):
                position += len(self._python_tag)
            elif self._python_tag.startswith(text[position:]):
                return None  # the tag may be under way
        else:
            rest = text[self._values[-1].end:]
            stripped = rest.lstrip()
            if stripped.startswith(";"):
                stripped = stripped[1:]
            position = len(text) - len(stripped.lstrip())
        return position if position < len(text) else None

    def parse(self, text: str) -> ParsedOutput:
        calls = self.calls(text)
        finished = finished_calls(calls) if len(calls) == len(self._values) else None
        return ParsedOutput(None, finished) if finished else ParsedOutput(text, [])


class MistralParser:
    """Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""

    start = "[TOOL_CALLS]"

    def __init__(self) -> None:
        self._value: JsonSpans | None = None

    def content_prefix(self, text: str) -> int:
        return _before_marker(text, self.start)

    def calls(self, text: str) -> list[CallSoFar]:
        if self._value is None:
            found = text.find(self.start)
            if found < 0:
                return []
            self._value = JsonSpans(found + len(self.start))
        self._value.feed(text)
        if self._value.value(text, ()).startswith("["):
            return array_calls(self._value, text, ("arguments",))
        call = call_so_far(self._value, text, (), ("arguments",))
        return [] if call is None else [call]

    def parse(self, text: str) -> ParsedOutput:
        calls = self.calls(text)
        finished = None
        if self._value is not None and self._value.done:
            is_array = self._value.value(text, ()).startswith("[")
            if len(calls) == (num_elements(self._value) if is_array else 1):
                finished = finished_calls(calls)
        if finished is None:
            return ParsedOutput(text, [])
        return ParsedOutput(_content(text[:text.find(self.start)]), finished)


PARSERS = {
    "hermes": HermesParser,
    "qwen25": HermesParser,  # Qwen2.5's template asks for Hermes' <tool_call> blocks
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
