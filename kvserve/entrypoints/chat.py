"""`kvserve chat`: an interactive conversation, streamed token by token."""

from __future__ import annotations

import sys

from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

# Lines that end the chat (as does Ctrl-D): an empty one, and what llama.cpp and ollama quit on.
QUIT_LINES = frozenset({"", "/exit", "/quit", "/bye"})


def run_chat(engine_args: EngineArgs, params: SamplingParams, system_prompt: str | None) -> int:
    llm = LLM(**vars(engine_args))
    engine = llm.engine
    conversation: list[dict[str, str]] = []
    if system_prompt:
        conversation.append({"role": "system", "content": system_prompt})
    interactive = sys.stdin.isatty()
    if interactive:
        print("kvserve chat: type a message; an empty line, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if line.strip() in QUIT_LINES:
            return 0
        conversation.append({"role": "user", "content": line})
        prompt_ids = llm.apply_chat_template(conversation)
        request = engine.add_request(None, {"prompt_token_ids": prompt_ids}, params)
        printed = ""
        finished = False
        while not finished:
            for output in engine.step():
                if output.request_id != request.request_id:
                    continue
                text = output.outputs[0].text
                print(text[len(printed):], end="", flush=True)
                printed, finished = text, output.finished
        print()
        conversation.append({"role": "assistant", "content": printed})
