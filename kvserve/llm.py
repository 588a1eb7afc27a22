"""Offline batch API, shaped like vLLM's `LLM`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.input_processor import PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.lora.request import LoRARequest
from kvserve.model_executor.loader import LoadedModel
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """`LLM(model=...)` loads a model; `generate` and `chat` run batches to completion.

    Keyword arguments are EngineArgs fields (max_num_seqs, block_size, kv_cache_memory, ...).
    """

    def __init__(
        self, model: str | None = None, loaded: LoadedModel | None = None, **engine_kwargs: Any
    ) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_kwargs), loaded)
        # Batches run to completion, with no idle time between them: deferred start-up work
        # (compile_decode=None's graphs) is done now.
        while self.engine.run_idle_work():
            pass

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        on_step: Callable[[], None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`; `on_step` is called after each engine step
        (benchmarks time the steps with it). Without `sampling_params`, the model's sampling
        defaults (generation_config.json) apply where it has them. `lora_request`: the LoRA
        adapter of every prompt, or one per prompt (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.engine.default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"got {len(lora_list)} LoRA requests for {len(prompt_list)} prompts")
        # Validate everything before scheduling anything, so a bad prompt adds nothing.
        prompt_list = [self.engine.prepare_prompt(prompt) for prompt in prompt_list]
        for prompt, params in zip(prompt_list, params_list):
            self.engine.validate(prompt.token_ids, params)
        for lora in lora_list:
            if lora is not None:
                self.engine.check_lora(lora)
        request_ids = [
            self.engine.add_request(None, prompt, params, priority=prio, lora_request=lora).request_id
            for prompt, params, prio, lora in zip(prompt_list, params_list, priorities, lora_list)
        ]
        return self._run(request_ids, use_tqdm, on_step)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """OpenAI-shaped messages; a message's content may be a list of text and image_url
        parts (data: URLs; file:// inside allowed_local_media_path; http(s) with
        allow_remote_media)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            conv, images = self.engine.split_chat_images(list(conv))
            prompt: dict[str, Any] = {"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError("this model has no chat template; use generate() with a prompt")
        return list(
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=True,
            )["input_ids"]
        )

    def _run(self, request_ids: list[str], use_tqdm: bool,
             on_step: Callable[[], None] | None = None) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="Generating") as bar:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"requests vanished from the engine: {sorted(pending)}")
                for output in self.engine.step(final_only=True):
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
                if on_step is not None:
                    on_step()
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """A single prompt (string, token-id list or dict) or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(
        isinstance(t, int) for t in prompts
    ):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            "prompts must be a string, a list of token ids, a dict, or a list of those; "
            f"got {type(prompts).__name__}"
        )
    return list(prompts)
