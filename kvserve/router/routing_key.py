"""The part of a request body the prefix tree matches on: the prompt as the worker sees it."""

from __future__ import annotations

from collections.abc import Sequence

# Separates chat messages in the key; a character no message is likely to contain.
_SEPARATOR = "\x1e"


def routing_key(body: dict) -> Sequence:
    """Prompt text (str), or token ids (tuple) for a token-id prompt; for several prompts,
    the first, whose prefix the batch most likely shares."""
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '')}:{content if isinstance(content, str) else ''}")
        return _SEPARATOR.join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return tuple(first)
        return tuple(prompt)
    return prompt if isinstance(prompt, str) else ""
