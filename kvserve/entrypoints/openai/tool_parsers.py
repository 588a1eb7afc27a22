"""Tool calls in a model's text (tool_choice "auto"), one parser per model family, chosen by
--tool-call-parser. Text that does not hold a well-formed call is content, as written."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ParsedOutput:
    content: str | None  # the text outside the calls (None when there is none)
    tool_calls: list[ToolCall]


def _call(obj: object, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[key] for key in arguments_keys if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


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

    def content_prefix(self, text: str) -> int:
        """Streaming: the length of the text's start that is certainly not a call."""
        return _before_marker(text, self.start)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(self.start)
        if first < 0:
            return ParsedOutput(text, [])
        calls = []
        for match in self._block.finditer(text, first):
            try:
                call = _call(json.loads(match.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(_content(text[:first]), calls)


class Llama3JsonParser:
    """Llama 3.x's JSON calls: `{"name": ..., "parameters": {...}}`, several separated by
    `;`, optionally after `<|python_tag|>`; the whole output is calls or none is."""

    _python_tag = "<|python_tag|>"

    def content_prefix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self._python_tag.startswith(stripped[:len(self._python_tag)]):
            return 0
        return len(text)

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self._python_tag).strip()
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            position = len(body) - len(rest)
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])


class MistralParser:
    """Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""

    start = "[TOOL_CALLS]"

    def content_prefix(self, text: str) -> int:
        return _before_marker(text, self.start)

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(self.start)
        if first < 0:
            return ParsedOutput(text, [])
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[first + len(self.start):].lstrip())
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        calls = [_call(item) for item in (obj if isinstance(obj, list) else [obj])]
        if not calls or None in calls:
            return ParsedOutput(text, [])
        return ParsedOutput(_content(text[:first]), calls)


PARSERS = {
    "hermes": HermesParser,
    "qwen25": HermesParser,  # Qwen2.5's template asks for Hermes' <tool_call> blocks
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
