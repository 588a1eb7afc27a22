"""The front's first stage: a prompt (text, token ids or a dict of either) and its
parameters checked and turned into an EngineCoreRequest, before anything is scheduled."""

from __future__ import annotations

import time
from typing import Any

from kvserve.engine.messages import EngineCoreInfo, EngineCoreRequest
from kvserve.lora.checker import AdapterChecker
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output import grammar as structured_grammar

NO_TOKENIZER = "this engine has no tokenizer (dummy weights or skip_tokenizer_init)"

PromptType = str | list[int] | dict[str, Any]


def context_length_error(max_model_len: int, num_prompt: int, max_tokens: int) -> ValueError:
    # Wording parsed by downstream tools (it is the OpenAI/vLLM message).
    return ValueError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {max_tokens} output tokens and your prompt contains {num_prompt} input "
        f"tokens, for a total of {num_prompt + max_tokens} tokens. Please reduce the length "
        "of the input prompt or the number of requested output tokens."
    )


class InputProcessor:
    def __init__(self, info: EngineCoreInfo) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.adapters = AdapterChecker(info.model_config, info.lora_config)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(f"{NO_TOKENIZER}: pass token ids")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}"
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before anything is scheduled; returns its max_tokens."""
        info = self.info
        vocab_size = info.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (got 0 tokens)")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        params.verify_token_ids(vocab_size)
        if params.n > info.max_num_seqs:
            # All n samples run side by side once the prompt is done: more never fit a step.
            raise ValueError(f"n must be at most max_num_seqs ({info.max_num_seqs}), got n={params.n}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{NO_TOKENIZER}: stop strings {params.stop!r} cannot be matched; use stop_token_ids")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(f"{NO_TOKENIZER}: structured_outputs constrain its vocabulary")
            structured_grammar.check(params.structured_outputs)
        num_prompt = len(prompt_token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = info.max_model_len - num_prompt
            if max_tokens < 1:
                raise context_length_error(info.max_model_len, num_prompt, 1)
        # The engine starts only if max_model_len fits the KV cache: so does the request.
        if num_prompt + max_tokens > info.max_model_len:
            raise context_length_error(info.max_model_len, num_prompt, max_tokens)
        return max_tokens

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """(prompt text if it was text, the request for the core)."""
        prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.adapters.check(lora_request)
        return prompt_text, EngineCoreRequest(
            request_id, prompt_token_ids, params, max_tokens, priority, arrival_time or time.time(),
            lora_request,
        )
