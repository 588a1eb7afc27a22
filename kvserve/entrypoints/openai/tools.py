"""Tool calling in chat completions: how tools and tool messages reach the prompt, what
tool_choice constrains the output to, and the assistant message built from the output."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvserve.entrypoints.openai.errors import OpenAIError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, Tool
from kvserve.entrypoints.openai.json_spans import JsonSpans
from kvserve.entrypoints.openai.tool_parsers import (
    PARSERS, CallSoFar, HermesParser, ParsedOutput, ToolCall, array_calls,
)
from kvserve.structured_output.params import StructuredOutputsParams

# For chat templates that do not render tools themselves (they never mention `tools`): the
# tools and the Hermes call format, in the system message.
DEFAULT_TOOL_PROMPT = (
    "You may call these tools; each is given as a JSON object with its name, description and "
    "the JSON schema of its parameters:\n{tools}\nTo call a tool, answer with one "
    '<tool_call>{{"name": <tool name>, "arguments": <arguments object>}}</tool_call> block per '
    "call and nothing else."
)


def tool_mode(request: ChatCompletionRequest, tool_call_parser: str | None) -> str:
    """"none", "auto", "required" or "named", after checking tool_choice against the tools."""
    choice = request.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise OpenAIError(400, f'tool_choice must be "none", "auto", "required" or a named function, '
                          f"got {choice!r}", param="tool_choice")
    if not request.tools:
        if choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        return "none"
    if choice is None:  # OpenAI's default when tools are given
        choice = "auto"
    if not isinstance(choice, str):
        names = [tool.function.name for tool in request.tools]
        if choice.function.name not in names:
            raise OpenAIError(400, f"tool_choice names the function {choice.function.name!r}, which "
                              f"is not among the tools ({', '.join(names)})", param="tool_choice")
        return "named"
    if choice == "auto" and tool_call_parser is None:
        raise OpenAIError(400, 'tool_choice "auto" needs the server started with --tool-call-parser '
                          '(or send tool_choice "required" or a named function)', param="tool_choice")
    return choice


def named_tool(request: ChatCompletionRequest) -> Tool:
    return next(t for t in request.tools if t.function.name == request.tool_choice.function.name)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(request: ChatCompletionRequest, mode: str) -> StructuredOutputsParams | None:
    """"named": the output is the function's arguments; "required": a JSON array of
    {"name", "parameters"} calls of the tools (one unless parallel_tool_calls)."""
    if mode == "named":
        return StructuredOutputsParams(json=_parameters(named_tool(request)))
    if mode != "required":
        return None
    call = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": tool.function.name}, "parameters": _parameters(tool)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for tool in request.tools
    ]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


class ConstrainedCalls:
    """The calls of a "named" or "required" output as it grows: a named function's output is
    its arguments object; "required" writes an array of {"name", "parameters"} objects."""

    def __init__(self, request: ChatCompletionRequest, mode: str) -> None:
        self.name = request.tool_choice.function.name if mode == "named" else None
        self._spans = JsonSpans()

    def calls(self, text: str) -> list[CallSoFar]:
        self._spans.feed(text)
        if self.name is None:
            return array_calls(self._spans, text, ("parameters",))
        if () not in self._spans.spans:
            return []
        return [CallSoFar(self.name, self._spans.value(text, ()), self._spans.done)]


def constrained_calls(text: str, request: ChatCompletionRequest, mode: str) -> list[ToolCall]:
    """The calls of a "named" or "required" output (it follows its schema unless it ran out
    of tokens, in which case it is returned as content)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return []
    calls = [call.finished_call() for call in ConstrainedCalls(request, mode).calls(text)]
    return [] if None in calls else calls


def parse_output(text: str, request: ChatCompletionRequest, mode: str, tool_call_parser: str | None) -> ParsedOutput:
    if mode in ("named", "required"):
        calls = constrained_calls(text, request, mode)
        return ParsedOutput(None if calls else text, calls)
    if mode == "auto":
        return PARSERS[tool_call_parser]().parse(text)
    return ParsedOutput(text, [])


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: ToolCall) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def conversation(messages: list[ChatMessage], tools: list[Tool] | None, template_takes_tools: bool) -> list[dict]:
    """Messages as a chat template reads them. A template that takes tools gets the tool
    calls and tool results as they are; for one that does not, they are written as Hermes
    blocks and the tools go into the system message (DEFAULT_TOOL_PROMPT)."""
    result = []
    for m in messages:
        if isinstance(m.content, list) and any(part.type != "text" for part in m.content):
            raise ValueError("image content parts are not supported here (only in chat completions)")
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(
            part.text for part in m.content)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if template_takes_tools:
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{content or ''}\n</tool_response>"}
        elif m.tool_calls:
            blocks = [f'{HermesParser.start}{{"name": {json.dumps(c.function.name)}, "arguments": '
                      f"{c.function.arguments}}}</tool_call>" for c in m.tool_calls]
            message["content"] = "\n".join(filter(None, [content, *blocks]))
        result.append(message)
    if tools and not template_takes_tools:
        listing = "\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False)
                            for t in tools)
        prompt = DEFAULT_TOOL_PROMPT.format(tools=listing)
        if result and result[0]["role"] == "system":
            result[0]["content"] = f"{result[0]['content']}\n\n{prompt}".lstrip()
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result


def _arguments(text: str) -> Any:
    """Templates index into the arguments (`arguments | tojson`, `arguments.items()`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
