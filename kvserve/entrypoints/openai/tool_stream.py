"""Streamed chat deltas of one choice when tools are in play, the way OpenAI streams tool
calls: a call's id and name first, then its arguments as fragments."""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.tool_parsers import PARSERS, ToolCall
from kvserve.entrypoints.openai.tools import constrained_calls, new_call_id


class ToolCallDeltas:
    """Turns a choice's growing text into deltas. "named": the text is the arguments, sent
    as it comes; "required": the calls once the output is complete; "auto": content as long
    as it cannot be the start of a call, then the parsed calls (or the held text, if it
    was not one) at the end."""

    def __init__(self, request: ChatCompletionRequest, mode: str, tool_call_parser: str | None) -> None:
        self.request = request
        self.mode = mode
        self.parser = PARSERS[tool_call_parser]() if mode == "auto" else None
        self.num_sent = 0  # characters of the text sent, as content or arguments
        self.num_calls = 0

    def update(self, text: str, finished: bool) -> list[dict]:
        if self.mode == "named":
            deltas = []
            if not self.num_calls and text:
                deltas.append(self._start(ToolCall(self.request.tool_choice.function.name, "")))
            if len(text) > self.num_sent:
                deltas.append(self._arguments(0, text[self.num_sent:]))
                self.num_sent = len(text)
            return deltas
        deltas = []
        if self.parser is not None:
            certain = self.parser.content_prefix(text)
            if certain > self.num_sent:
                deltas.append({"content": text[self.num_sent:certain]})
                self.num_sent = certain
        if not finished:
            return deltas
        calls = (constrained_calls(text, self.request, self.mode) if self.parser is None
                 else self.parser.parse(text).tool_calls)
        for call in calls:
            deltas += [self._start(call), self._arguments(self.num_calls - 1, call.arguments)]
        if not calls and len(text) > self.num_sent:
            deltas.append({"content": text[self.num_sent:]})
        self.num_sent = len(text)
        return deltas

    def _start(self, call: ToolCall) -> dict:
        self.num_calls += 1
        return {"tool_calls": [{"index": self.num_calls - 1, "id": new_call_id(), "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}

    @staticmethod
    def _arguments(index: int, fragment: str) -> dict:
        return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
