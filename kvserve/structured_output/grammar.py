"""A request's constraint as an xgrammar Grammar, which also checks it: a schema, regex or
grammar that does not compile is a ValueError naming the field, raised in the front
before anything is queued."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from kvserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# Parsing a large schema costs milliseconds; requests of one application repeat theirs.
_CHECKED_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A constraint that does not compile: `kind` is the StructuredOutputsParams field."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind} {reason}")
        self.kind = kind
        self.reason = reason


def choice_ebnf(choices: list[str]) -> str:
    """One of the strings, exactly (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    return _build(params.key)


def check(params: StructuredOutputsParams) -> None:
    """Raises GrammarError unless it compiles."""
    _build(params.key)


@functools.lru_cache(maxsize=_CHECKED_CACHE_SIZE)
def _build(key: tuple) -> xgrammar.Grammar:
    import xgrammar as xgr

    kind, content, disable_any_whitespace = key
    try:
        if kind == "json":
            _check_schema(content)
            return xgr.Grammar.from_json_schema(
                content, any_whitespace=not disable_any_whitespace, strict_mode=True,
            )
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(content)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(list(content)))
        return xgr.Grammar.from_ebnf(content)
    except (RuntimeError, ValueError, TypeError) as error:
        what = {"json": "is not a usable JSON schema", "regex": "does not compile",
                "grammar": "does not compile", "choice": "does not compile"}.get(kind, "is invalid")
        lines = str(error).strip().splitlines()
        raise GrammarError(kind, f"{what}: {lines[0] if lines else repr(error)}") from None


# Keywords xgrammar's schema converter accepts but does not enforce: a schema using them would
# be followed only in part, so it is refused instead.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedProperties",
    "unevaluatedItems", "contentEncoding", "contentMediaType",
})


def _check_schema(schema: str) -> None:
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError(f"a schema is an object or a boolean, got {type(parsed).__name__}")
    unsupported = sorted(set(_unsupported(parsed, "#")))
    if unsupported:
        raise ValueError(f"uses keywords that cannot be enforced: {', '.join(unsupported)}")


def _unsupported(node: object, path: str) -> list[str]:
    """'keyword at path' for every unenforceable keyword in a schema (enum and const values
    are data, not schemas)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in UNSUPPORTED_KEYWORDS or (key == "multipleOf" and node.get("type") != "integer"):
                found.append(f"{key} at {path}")
            if key not in ("enum", "const", "default", "examples"):
                found += _unsupported(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            found += _unsupported(item, f"{path}/{index}")
    return found
