"""The front's first stage: a prompt (text, token ids or a dict of either) and its
parameters checked and turned into an EngineCoreRequest, before anything is scheduled."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from kvserve.engine.messages import EngineCoreInfo, EngineCoreRequest
from kvserve.multimodal.inputs import ImageFeature
from kvserve.multimodal.processing import ImageProcessing
from kvserve.lora.checker import AdapterChecker
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output import grammar as structured_grammar

NO_TOKENIZER = "this engine has no tokenizer (dummy weights or skip_tokenizer_init)"



@dataclass
class PreparedPrompt:
    """A prompt tokenized, its images preprocessed and their placeholders expanded: what
    `InputProcessor.prepare` makes of any prompt, accepted as a prompt itself."""

    text: str | None
    token_ids: list[int]
    mm_features: list[ImageFeature] = field(default_factory=list)


PromptType = str | list[int] | dict[str, Any] | PreparedPrompt


def context_length_error(max_model_len: int, num_prompt: int, max_tokens: int) -> ValueError:
    # Wording parsed by downstream tools (it is the OpenAI/vLLM message).
    return ValueError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {max_tokens} output tokens and your prompt contains {num_prompt} input "
        f"tokens, for a total of {num_prompt + max_tokens} tokens. Please reduce the length "
        "of the input prompt or the number of requested output tokens."
    )


class InputProcessor:
    def __init__(self, info: EngineCoreInfo, image_processing: ImageProcessing | None = None,
                 image_limit: int = 0) -> None:
        """`image_processing`: the model's (None: it takes no images); `image_limit`: most
        images a prompt may carry."""
        self.info = info
        self.tokenizer = info.tokenizer
        self.image_processing = image_processing
        self.image_limit = image_limit
        self.adapters = AdapterChecker(info.model_config, info.lora_config)

    def prepare(self, prompt: PromptType) -> PreparedPrompt:
        """Tokenize the prompt and expand its images (vLLM's {"prompt": ..., "multi_modal_data":
        {"image": PIL image or list}}); raises ValueError for anything wrong with them."""
        if isinstance(prompt, PreparedPrompt):
            return prompt
        images: list[Any] = []
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            images = self._images(prompt["multi_modal_data"])
        text, token_ids = self.tokenize_prompt(prompt)
        if self.image_processing is None:
            return PreparedPrompt(text, token_ids)
        token_ids, features = self.image_processing.process(token_ids, images)
        if len(token_ids) > self.info.max_model_len:
            num_image = sum(f.length for f in features)
            raise ValueError(
                f"the prompt's {len(features)} image(s) take {num_image} tokens after preprocessing; "
                f"with its text that is {len(token_ids)} tokens, more than the model's maximum context "
                f"length of {self.info.max_model_len} tokens")
        return PreparedPrompt(text, token_ids, features)

    def _images(self, data: Any) -> list[Image.Image]:
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict with an 'image' entry")
        images = data.get("image")
        images = images if isinstance(images, (list, tuple)) else [images]
        if self.image_processing is None:
            raise ValueError(f"this model ({self.info.model_config.architecture}) does not take images")
        if not all(isinstance(image, Image.Image) for image in images):
            raise ValueError("multi_modal_data['image'] must be a PIL image or a list of PIL images")
        if len(images) > self.image_limit:
            raise ValueError(f"at most {self.image_limit} image(s) per prompt are allowed "
                             f"(limit_mm_per_prompt), got {len(images)}")
        return list(images)

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
        prepared = self.prepare(prompt)
        max_tokens = self.validate(prepared.token_ids, params)
        if lora_request is not None:
            self.adapters.check(lora_request)
        return prepared.text, EngineCoreRequest(
            request_id, prepared.token_ids, params, max_tokens, priority, arrival_time or time.time(),
            prepared.mm_features, lora_request,
        )
