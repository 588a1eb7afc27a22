"""Streamed chat deltas of one choice when tools are in play, the way OpenAI streams tool
calls: a call's id and name as soon as the name is written, then its arguments in
fragments as the model writes them."""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.tool_parsers import PARSERS
from kvserve.entrypoints.openai.tools import ConstrainedCalls, new_call_id


class ToolCallDeltas:
    """Turns a choice's growing text into deltas. "named" and "required": the calls as they
    are written (the output is nothing else); "auto": content as long as the text cannot be
    the start of a call, then the calls as the parser finds them, or, if the text was no
    call after all, the held text at the end."""

    def __init__(self, request: ChatCompletionRequest, mode: str, tool_call_parser: str | None) -> None:
        self.parser = PARSERS[tool_call_parser]() if mode == "auto" else None
        self.calls = self.parser if self.parser is not None else ConstrainedCalls(request, mode)
        self.num_sent = 0  # characters of the text sent as content
        self.arguments_sent: list[str] = []  # each started call's arguments sent so far

    @property
    def num_calls(self) -> int:
        return len(self.arguments_sent)

    def update(self, text: str, finished: bool) -> list[dict]:
        deltas = []
        if self.parser is not None and not self.num_calls:
            certain = self.parser.content_prefix(text)
            if certain > self.num_sent:
                deltas.append({"content": text[self.num_sent:certain]})
                self.num_sent = certain
        for index, call in enumerate(self.calls.calls(text)):
            if call.name is None:
                break
            if index == self.num_calls:
                deltas.append(self._start(index, call.name))
            sent = self.arguments_sent[index]
            # Arguments only grow (unless a model writes both keys they may be under).
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(self._arguments(index, call.arguments[len(sent):]))
                self.arguments_sent[index] = call.arguments
        if finished and not self.num_calls and len(text) > self.num_sent:
            deltas.append({"content": text[self.num_sent:]})
            self.num_sent = len(text)
        return deltas

    def _start(self, index: int, name: str) -> dict:
        self.arguments_sent.append("")
        return {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    @staticmethod
    def _arguments(index: int, fragment: str) -> dict:
        return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
