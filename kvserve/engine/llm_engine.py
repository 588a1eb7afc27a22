"""The engine's front: a prompt is tokenized and validated (input processor), handed to
the engine core as plain data, and the core's per-step deltas come back as RequestOutputs
(output processor). A step is schedule -> execute -> update in the core (core.py)."""

from __future__ import annotations

import itertools
import logging
import os

from kvserve.engine.core import EngineCore
from kvserve.engine.core_client import EngineCoreClient, InprocClient
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.input_processor import InputProcessor, PreparedPrompt, PromptType
from kvserve.engine.messages import SchedulerStats
from kvserve.engine.output_processor import OutputProcessor, RequestState
from kvserve.lora.request import LoRARequest
from kvserve.model_executor.loader import LoadedModel
from kvserve.multimodal.chat import split_images
from kvserve.multimodal.media import MediaPolicy
from kvserve.multimodal.processing import ImageProcessing
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets several engines (e.g. configurations under comparison) share weights."""
        self.args = args
        self.device = args.resolved_device()
        self.core: EngineCore | None = None  # in this process (the default), for inspection
        if args.multiprocess_engine_core:
            if loaded is not None:
                raise ValueError("multiprocess_engine_core loads the model in the core's process: "
                                 "it cannot take a model loaded here")
            from kvserve.engine.core_proc import MPClient

            self.client: EngineCoreClient = MPClient(args)
        else:
            self.core = EngineCore(args, loaded)
            self.client = InprocClient(self.core)
        info = self.client.info
        self.model_config = info.model_config
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.sampling_defaults = self._sampling_defaults(args.generation_config)
        self.image_processing = self._image_processing(args)
        self.media_policy = MediaPolicy(args.allowed_local_media_path, args.allow_remote_media)
        self.input_processor = InputProcessor(info, self.image_processing, args.image_limit)
        self.output_processor = OutputProcessor(info.tokenizer, speculating=args.speculative_config is not None)
        self._request_counter = itertools.count()
        self.num_steps = 0  # the core's steps that ran the model, as of its latest outputs

    def _image_processing(self, args: EngineArgs) -> ImageProcessing | None:
        """The model's image processor, for a model that takes images."""
        config = self.model_config
        if not config.is_multimodal:
            return None
        model_dir = args.model if args.model is not None and os.path.isdir(args.model) else None
        return ImageProcessing.for_model(model_dir, config.architecture, config.hf_config or {},
                                         config.image_token_id)

    def _sampling_defaults(self, generation_config: str) -> dict[str, float]:
        """What requests that leave a sampling value unset take (--generation-config)."""
        if generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be auto or none; got {generation_config!r}")
        defaults = dict(self.model_config.sampling_defaults) if generation_config == "auto" else {}
        if defaults:
            try:
                SamplingParams(**defaults)
            except ValueError as e:
                raise ValueError(f"the model's generation_config.json sampling values {defaults}: {e} "
                                 "(--generation-config none ignores them)") from None
            logger.info("sampling defaults from the model's generation_config.json: %s "
                        "(requests that set a value keep theirs; --generation-config none ignores them)",
                        ", ".join(f"{k}={v}" for k, v in defaults.items()))
        return defaults

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams for a request that sets nothing: the model's defaults where it has them."""
        return SamplingParams(**self.sampling_defaults)

    # -- requests --------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize_prompt(prompt)

    def prepare_prompt(self, prompt: PromptType) -> PreparedPrompt:
        """Tokenized, with its images preprocessed and their placeholders expanded."""
        return self.input_processor.prepare(prompt)

    def split_chat_images(self, messages: list[dict]) -> tuple[list[dict], list]:
        """Chat messages with image parts -> (messages a chat template reads, the images)."""
        placeholder = None if self.image_processing is None else self.image_processing.placeholder_text
        return split_images(messages, placeholder, self.media_policy, self.args.image_limit)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before anything is scheduled; returns its max_tokens."""
        return self.input_processor.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestState:
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        prompt_text, request = self.input_processor.process(request_id, prompt, params, arrival_time, priority,
                                                            lora_request)
        self.client.add_request(request)
        return self.output_processor.add_request(request, prompt_text)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (raises LoRAError), before any request uses it."""
        self.input_processor.adapters.check(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter: requests still running on it finish; new ones must load it again."""
        self.input_processor.adapters.forget(lora_int_id)
        self.client.remove_lora(lora_int_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        output = self.output_processor.abort(request_id)
        if output is not None:
            self.client.abort_requests([request_id])
        return output

    @property
    def requests(self) -> dict[str, RequestState]:
        """The requests in flight, by id."""
        return self.output_processor.requests

    def has_unfinished_requests(self) -> bool:
        """Also true while the core has a step in flight, so that stepping drains it."""
        return bool(self.output_processor.requests) or self.client.has_unfinished_requests()

    def run_idle_work(self) -> bool:
        """One piece of deferred start-up work, for when no request is waiting: a CPU decode
        graph of serve's default compile-decode. Returns whether there was any."""
        return self.client.run_idle_work()

    def dead_reason(self) -> str | None:
        """Why the engine cannot run steps any more (a worker process died), or None."""
        return self.client.dead_reason()

    def start_background_work(self) -> None:
        """Start the deferred start-up work beside the steps (a server's way: requests never
        wait for it)."""
        self.client.start_background_work()

    def stats(self) -> SchedulerStats:
        return self.client.stats()

    def dashboard_snapshot(self) -> dict:
        """The live dashboard's view of the core: block map, queues, recent steps."""
        return self.client.dashboard_snapshot()

    @property
    def num_requests_running(self) -> int:
        return self.stats().num_running_reqs

    @property
    def num_requests_waiting(self) -> int:
        return self.stats().num_waiting_reqs

    @property
    def decode_graphs_pending(self) -> int:
        """CPU decode graphs of serve's default compile-decode not compiled yet."""
        return self.stats().decode_graphs_pending

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        return self.stats().spec_decode

    def shutdown(self) -> None:
        self.client.shutdown()

    # -- the step --------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Runs one iteration; returns an output for every request that got tokens (only
        for those that finished, with final_only: building outputs costs host time)."""
        core_outputs = self.client.step()
        if core_outputs.stats is not None:
            self.num_steps = core_outputs.stats.num_steps
        outputs, stops = self.output_processor.process(core_outputs, final_only)
        for request_id, error in core_outputs.failed_requests.items():
            output = self.output_processor.abort(request_id, error)
            if output is not None:
                outputs.append(output)
        if stops:
            self.client.stop_sequences(stops)
        return outputs
