"""Where the values of one JSON text begin and end, read as the text grows, so a tool call's
name and its arguments can be found (and the arguments streamed as written) before the
model has finished writing it."""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_SCALAR_END = _WHITESPACE + ",]}"
# What numbers, true, false and null are written with (json.loads checks the rest).
_SCALAR_START = "-0123456789tfn"
_SCALAR_CHARS = "+-.0123456789eEtruefalsn"

Path = tuple  # keys (objects) and indices (arrays) from the root value; () is the root


@dataclass
class _Container:
    path: Path
    is_object: bool
    expect: str  # "first" (just opened), "member" (after a comma), "colon", "value", "comma"
    key: str | None = None
    index: int = 0


@dataclass
class Span:
    start: int
    end: int | None = None  # one past the value's last character, once it is known


class JsonSpans:
    """Scans the JSON value that starts at or after `start` (whitespace skipped), recording
    the span of every value down to `max_depth` levels (by path). `feed` takes the whole
    text so far and reads only what is new. Text that is not JSON stops the scan
    (`invalid`); what follows the value is not read."""

    def __init__(self, start: int = 0, max_depth: int = 2) -> None:
        self.max_depth = max_depth
        self.position = start
        self.spans: dict[Path, Span] = {}
        self.done = False
        self.invalid = False
        self._stack: list[_Container] = []
        self._string_start: int | None = None  # inside a string that began here
        self._string_path: Path | None = None  # a value's; None for an object's key
        self._escaped = False
        self._scalar_path: Path | None = None  # inside a number or literal

    @property
    def end(self) -> int | None:
        return self.spans[()].end if self.done else None

    def value(self, text: str, path: Path) -> str:
        """The text of the value at `path` as far as it is read ('' when it has not begun)."""
        span = self.spans.get(path)
        if span is None:
            return ""
        return text[span.start:self.position if span.end is None else span.end]

    def feed(self, text: str) -> None:
        position = self.position
        while position < len(text) and not (self.done or self.invalid):
            char = text[position]
            if self._string_start is not None:
                self._read_string(text, position, char)
            elif self._scalar_path is not None and char not in _SCALAR_END:
                if char not in _SCALAR_CHARS:
                    self.invalid = True
                    break
            else:
                if self._scalar_path is not None:
                    path, self._scalar_path = self._scalar_path, None
                    self._end_value(position, path)
                if char not in _WHITESPACE and not self.done:
                    self._read_structure(position, char)
                    if self.invalid:
                        break
            position += 1
        self.position = position

    def _read_string(self, text: str, position: int, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            start, self._string_start = self._string_start, None
            if self._string_path is not None:
                self._end_value(position + 1, self._string_path)
                return
            container = self._stack[-1]
            try:
                container.key = json.loads(text[start:position + 1])
            except json.JSONDecodeError:
                self.invalid = True
            container.expect = "colon"

    def _read_structure(self, position: int, char: str) -> None:
        container = self._stack[-1] if self._stack else None
        if container is None:
            self._start_value(position, char, ())
            return
        expect = container.expect
        if container.is_object and expect in ("first", "member"):
            if char == '"':
                self._string_start, self._string_path = position, None
            elif char == "}" and expect == "first":
                self._close(position)
            else:
                self.invalid = True
        elif container.is_object and expect == "colon":
            if char == ":":
                container.expect = "value"
            else:
                self.invalid = True
        elif expect == "comma":
            if char == ",":
                container.expect = "member"
                container.index += 1
            elif char == ("}" if container.is_object else "]"):
                self._close(position)
            else:
                self.invalid = True
        elif char == "]" and expect == "first":  # an empty array
            self._close(position)
        elif char in "}]":
            self.invalid = True
        else:
            step = container.key if container.is_object else container.index
            self._start_value(position, char, (*container.path, step))

    def _start_value(self, position: int, char: str, path: Path) -> None:
        if len(path) <= self.max_depth:
            self.spans[path] = Span(position)
        if char in "{[":
            self._stack.append(_Container(path, char == "{", "first"))
        elif char == '"':
            self._string_start, self._string_path = position, path
        elif char in _SCALAR_START:
            self._scalar_path = path
        else:
            self.invalid = True

    def _close(self, position: int) -> None:
        self._end_value(position + 1, self._stack.pop().path)

    def _end_value(self, end: int, path: Path) -> None:
        """The value at `path` ended: record its end; its container now expects a comma."""
        span = self.spans.get(path)
        if span is not None:
            span.end = end
        if self._stack:
            self._stack[-1].expect = "comma"
        else:
            self.done = True
