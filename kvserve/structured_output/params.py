"""What a request constrains its output to, shaped like vLLM's StructuredOutputsParams:
exactly one of a JSON schema, any JSON object, a regex, a list of choices or an EBNF
grammar. Plain, picklable data; whether the content compiles is checked by grammar.py."""

from __future__ import annotations

import json as json_lib
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema, as text or parsed
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style), its start rule named `root`
    # JSON without free whitespace between tokens (a small model can emit it forever).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                f"got {', '.join(chosen) or 'none'}"
            )
        if isinstance(self.json, dict):
            try:
                # Key order kept: a schema's property order is the order the output writes them.
                self.json = json_lib.dumps(self.json)
            except (TypeError, ValueError) as error:
                raise ValueError(f"structured_outputs.json is not JSON-serialisable: {error}") from None
        for kind, expected in (("json", str), ("regex", str), ("grammar", str)):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, expected):
                raise ValueError(f"structured_outputs.{kind} must be a string, got {type(value).__name__}")
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                                 f"strings, got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: equal keys share one compile."""
        kind = self.kind
        content = tuple(self.choice) if kind == "choice" else getattr(self, kind)
        return kind, content, self.disable_any_whitespace
