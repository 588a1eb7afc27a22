"""The step loop: schedule, run the model, sample, append, detokenize, check stops, emit."""

from __future__ import annotations

import itertools
from dataclasses import replace
import logging
import time
from typing import Any

import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched.output import SchedulerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.quantization.cpu_plan import (
    AUTO,
    NONE,
    apply_plan,
    gguf_too_large_to_dequantize,
    resolve_auto_quantization,
)
from kvserve.engine.cpu_malloc import retain_freed_memory
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.overlap import InflightStep, can_sample_ahead
from kvserve.engine.request import Request
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.loader import LoadedModel, load_model
from kvserve.model_executor.model_runner import ModelRunner, kv_cache_bytes_per_block
from kvserve.outputs import CompletionOutput, GrowingListPrefix, RequestMetrics, RequestOutput
from kvserve.sample.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.speculator import Speculator
from kvserve.spec_decode.stats import SpecDecodeStats
from kvserve.utils import to_device_async

logger = logging.getLogger(__name__)

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


def load_engine_model(args: EngineArgs) -> LoadedModel:
    """The model as an engine built from `args` runs it: loaded, and quantized as
    `args.quantization` says ("auto": the per-device plan of quantization/cpu_plan.py, logged; "none":
    not at all). Benchmarks that compare engine configurations on one copy of the weights
    load it once with this and pass it to each engine."""
    device = args.resolved_device()
    quantization = None if args.quantization == NONE else args.quantization
    auto = quantization == AUTO
    if auto and device.type == "cpu" and args.load_format != "dummy":
        path = args.model or default_model_path()
        too_large = gguf_too_large_to_dequantize(path) if path.endswith(".gguf") else None
        if too_large is not None:
            logger.warning("quantization=auto: %s", too_large)
            quantization, auto = "gguf", False
    loaded = load_model(
        args.model, load_format=args.load_format, model_shape=args.model_shape,
        dtype=args.resolved_dtype(device), device=device, seed=args.seed, tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init,
        quantization=None if auto else quantization,
        quantization_config=None if auto else args.quantization_config,
    )
    if auto:
        plan = resolve_auto_quantization(loaded, device)
        for reason in plan.reasons:
            logger.info("quantization=auto: %s", reason)
        apply_plan(loaded, plan)
    return loaded


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets several engines (e.g. configurations under comparison) share weights."""
        self.args = args
        self.device = args.resolved_device()
        dtype = args.resolved_dtype(self.device)
        if args.quantization == NONE:
            args = replace(args, quantization=None)
        if loaded is None:
            loaded = load_engine_model(args)
        if self.device.type == "cpu":  # after loading: its transients are not kept
            retain_freed_memory()
        if args.max_num_batched_tokens is None:
            logger.info(
                "max_num_batched_tokens=%d (per-device default%s)",
                args.resolved_max_num_batched_tokens(self.device),
                ": small prefill chunks on CPU so one step does not hold every stream for seconds"
                if self.device.type == "cpu" else "",
            )
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.sampling_defaults = self._sampling_defaults(args.generation_config)
        self.max_model_len = args.max_model_len or self.model_config.max_position_embeddings
        self.cache_config = CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_bytes(),
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_dtype=args.resolved_kv_cache_dtype(),
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.resolved_max_num_batched_tokens(self.device),
            enable_chunked_prefill=args.enable_chunked_prefill,
            policy=args.scheduling_policy,
        )
        spec_config = draft = None
        if args.speculative_config is not None:
            # Validated and the draft loaded before the target's cache is sized, so a bad
            # config fails fast and the draft's weights count against GPU memory.
            spec_config = SpeculativeConfig.from_dict(args.speculative_config)
            if spec_config.method == "draft_model":
                from kvserve.spec_decode.draft_model_proposer import load_draft_model

                draft = load_draft_model(spec_config, loaded, dtype, self.device)
        self.runner = ModelRunner(
            loaded.model, self.model_config, self.cache_config, self.scheduler_config,
            self.device, args.attention_backend, self.max_model_len, args.enforce_eager,
            extra_kv_bytes_per_block=(
                0 if draft is None else kv_cache_bytes_per_block(draft.config, args.block_size)
            ),
            max_draft_tokens=0 if spec_config is None else spec_config.num_speculative_tokens,
            max_verify_batch=None if spec_config is None else spec_config.disable_by_batch_size,
            compile_decode=args.compile_decode,
        )
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache)
        self.sampler = Sampler()
        self.speculator = None if spec_config is None else self._make_speculator(spec_config, draft)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self.overlap_scheduling = args.resolved_overlap_scheduling(self.device) and self.speculator is None
        self._inflight: InflightStep | None = None
        self.num_steps_ahead = 0  # decode steps launched before the previous one was read
        logger.info(
            "kvserve engine: %s layers=%d dtype=%s device=%s attention=%s, %d KV blocks (%s) of "
            "%d tokens (%d tokens), max_model_len=%d, overlapped scheduling %s",
            self.model_config.architecture, self.model_config.num_hidden_layers,
            str(dtype).removeprefix("torch."), self.device,
            type(self.runner.attn_backend).__name__,
            self.runner.num_blocks,
            str(self.runner.kv_cache_dtype).removeprefix("torch."),
            args.block_size, self.runner.num_blocks * args.block_size, self.max_model_len,
            "on" if self.overlap_scheduling else "off",
        )

    def _make_speculator(self, config: SpeculativeConfig, draft: LoadedModel | None) -> Speculator:
        if draft is None:
            from kvserve.spec_decode.ngram_proposer import NgramProposer

            proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        else:
            from kvserve.spec_decode.draft_model_proposer import DraftModelProposer

            # As many blocks as the target: the draft never holds more tokens than it.
            proposer = DraftModelProposer(
                draft, self.runner.num_blocks, self.args.block_size, self.device,
                self.args.attention_backend, self.model_config.eos_token_ids,
                min(config.disable_by_batch_size, self.scheduler_config.max_num_seqs),
            )
        logger.info("speculative decoding: %s", config)
        return Speculator(config, proposer, self.max_model_len)

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        return None if self.speculator is None else self.speculator.stats

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
        vocab_size = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (got 0 tokens)")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        params.verify_token_ids(vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{NO_TOKENIZER}: stop strings {params.stop!r} cannot be matched; use stop_token_ids")
        num_prompt = len(prompt_token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
            if max_tokens < 1:
                raise context_length_error(self.max_model_len, num_prompt, 1)
        if num_prompt + max_tokens > self.max_model_len:
            raise context_length_error(self.max_model_len, num_prompt, max_tokens)
        needed = self.kv_cache.num_blocks_needed(num_prompt + max_tokens)
        if needed > self.runner.num_blocks:
            raise ValueError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs {needed} KV "
                f"blocks but the cache has only {self.runner.num_blocks}; raise --kv-cache-memory"
            )
        return max_tokens

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(prompt_token_ids, params)
        request = Request(
            request_id, prompt_text, prompt_token_ids, params, priority=priority,
            arrival_time=arrival_time or time.time(), max_tokens=max_tokens,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.requests[request_id] = request
        seq = self._new_sequence(request, 0)
        self.scheduler.add(seq)
        return request

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        generator = None
        if request.params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.params.seed + index)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params
            )
        seq = Sequence(f"{request.request_id}#{index}", request, index, generator, detokenizer)
        request.sequences.append(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        request.finished = True
        request.times.finished = time.time()
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        return self._make_output(request)

    def has_unfinished_requests(self) -> bool:
        """Also true while a step is in flight, so that stepping drains it."""
        return bool(self.requests) or self._inflight is not None

    @property
    def decode_graphs_pending(self) -> int:
        """CPU decode graphs of serve's default compile-decode not compiled yet."""
        compiled = self.runner.compiled_decode
        return 0 if compiled is None else compiled.pending

    def run_idle_work(self) -> bool:
        """One piece of deferred start-up work, for when no request is waiting: a CPU decode
        graph of serve's default compile-decode. Returns whether there was any."""
        return not self.has_unfinished_requests() and self.runner.compile_idle()

    @property
    def num_requests_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_requests_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step --------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Runs one iteration; returns an output for every request that got tokens (only
        for those that finished, with final_only: building outputs costs host time).

        With overlapped scheduling a decode step's tokens are read one call later: the
        call launches the next step first (see kvserve/engine/overlap.py)."""
        if self._inflight is None:
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running)
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            now = time.time()
            seqs = self.scheduler.scheduled(sched)
            for seq in seqs:
                if seq.request.times.first_scheduled is None:
                    seq.request.times.first_scheduled = now
                    seq.request.num_cached_tokens = seq.num_computed_tokens
            if not self._can_defer(sched, seqs):
                return self._run_step(sched, seqs, final_only)
            self._inflight = self._launch(sched, seqs)
        inflight = self._inflight
        self._inflight = self._launch_ahead(inflight)
        return self._finish_inflight(inflight, final_only)

    def _run_step(
        self, sched: SchedulerOutput, seqs: list[Sequence], final_only: bool
    ) -> list[RequestOutput]:
        """A step from schedule to outputs, waiting for the device."""
        step_logits = self.runner.execute(sched)
        self.scheduler.advance(sched, seqs)

        for seq_id, logits, first_target in step_logits.prompt_logits:
            request = self.scheduler.seqs[seq_id].request
            if first_target < len(request.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            targets = request.prompt_token_ids[first_target : first_target + logits.shape[0]]
            request.prompt_logprobs.extend(
                compute_prompt_logprobs(logits, targets, request.params.prompt_logprobs)
            )

        # Plain decodes and prefills sample one row; sequences with drafts verify 1 + k.
        plain_seqs, plain_rows, spec_seqs, spec_rows = [], [], [], []
        row = 0
        for seq_id, num_rows in zip(step_logits.sampling_seq_ids, step_logits.num_sample_rows):
            seq = self.scheduler.seqs[seq_id]
            if num_rows == 1:
                plain_seqs.append(seq)
                plain_rows.append(row)
            else:
                spec_seqs.append(seq)
                spec_rows.extend(range(row, row + num_rows))
            row += num_rows
        touched: dict[str, Request] = {}
        rows, row_seqs, logit_rows = self._sampling_rows(plain_seqs)
        if rows:
            logits = step_logits.sample_logits[[plain_rows[i] for i in logit_rows]]
            out = self.sampler(logits, rows)
            token_time = time.time()
            for seq, token_id, logprobs in zip(row_seqs, out.token_ids, out.logprobs):
                self._append_token(seq, token_id, logprobs)
                self._mark_token_time(seq.request, token_time)
                touched[seq.request.request_id] = seq.request
        if spec_seqs:
            verified = self.speculator.verify(
                step_logits.sample_logits[spec_rows], spec_seqs, self.model_config.eos_token_ids
            )
            token_time = time.time()
            for seq, result in zip(spec_seqs, verified):
                self._append_verified(seq, result.run.token_ids, result.logprobs,
                                      result.run.num_accepted)
                self._mark_token_time(seq.request, token_time)
                touched[seq.request.request_id] = seq.request

        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        return self._outputs(touched, final_only)

    # -- overlapped decode steps -----------------------------------------------------------

    def _can_defer(self, sched: SchedulerOutput, seqs: list[Sequence]) -> bool:
        """A step whose tokens may be read later: every sequence decodes one token and can
        be sampled ahead."""
        return self.overlap_scheduling and all(
            sched.num_scheduled_tokens[seq.seq_id] == 1
            and seq.num_computed_tokens + 1 == seq.num_tokens
            and can_sample_ahead(seq)
            for seq in seqs
        )

    def _launch(self, sched: SchedulerOutput, seqs: list[Sequence]) -> InflightStep:
        step_logits = self.runner.execute(sched)
        self.scheduler.advance(sched, seqs)
        rows, _, _ = self._sampling_rows(seqs)
        return InflightStep.start(seqs, self.sampler.sample_ids(step_logits.sample_logits, rows))

    def _launch_ahead(self, inflight: InflightStep) -> InflightStep | None:
        """The next decode step of the in-flight step's sequences, fed its sampled ids on
        the device; None when it must wait for the host (requests waiting for admission,
        too few free blocks, nothing left to run)."""
        seqs, rows = [], []
        for row, seq in enumerate(inflight.seqs):
            if seq.status is not SequenceStatus.RUNNING or self._ends_at_inflight_token(seq):
                continue
            if not can_sample_ahead(seq):
                return None
            seqs.append(seq)
            rows.append(row)
        if not seqs:
            return None
        sched = self.scheduler.schedule_ahead(seqs)
        if sched is None:
            return None
        token_ids = inflight.token_ids
        if len(rows) < len(inflight.seqs):
            token_ids = token_ids[to_device_async(rows, torch.long, token_ids.device)]
        logits = self.runner.execute_ahead(sched, token_ids)
        self.scheduler.advance(sched, seqs)
        self.num_steps_ahead += 1
        sampling_rows, _, _ = self._sampling_rows(seqs)
        return InflightStep.start(seqs, self.sampler.sample_ids(logits, sampling_rows))

    def _ends_at_inflight_token(self, seq: Sequence) -> bool:
        """Whether the token in flight is certainly the sequence's last (length limits)."""
        return (
            len(seq.output_token_ids) + 1 >= seq.request.max_tokens
            or seq.num_tokens + 1 >= self.max_model_len
        )

    def _finish_inflight(self, inflight: InflightStep, final_only: bool) -> list[RequestOutput]:
        token_ids = inflight.read()
        token_time = time.time()
        touched: dict[str, Request] = {}
        for seq, token_id in zip(inflight.seqs, token_ids):
            if seq.status.is_finished:
                continue  # ended by the step before (its extra token is dropped) or aborted
            self._append_token(seq, token_id, None)
            self._mark_token_time(seq.request, token_time)
            touched[seq.request.request_id] = seq.request
            if not seq.status.is_finished:
                self.scheduler.cache_computed_blocks(seq)
        return self._outputs(touched, final_only)

    def _outputs(self, touched: dict[str, Request], final_only: bool) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if all(seq.status.is_finished for seq in request.sequences):
                request.finished = True
                request.times.finished = time.time()
                del self.requests[request.request_id]
            if request.finished or not final_only:
                outputs.append(self._make_output(request))
        return outputs

    def _sampling_rows(
        self, sampling_seqs: list[Sequence]
    ) -> tuple[list[SamplingRow], list[Sequence], list[int]]:
        """One row per sequence to sample; a prompt finishing its prefill forks into n rows."""
        rows, row_seqs, logit_rows = [], [], []
        eos_ids = self.model_config.eos_token_ids
        for logit_row, seq in enumerate(sampling_seqs):
            family = [seq]
            request = seq.request
            if len(request.sequences) == 1 and request.params.n > 1:
                for index in range(1, request.params.n):
                    child = self._new_sequence(request, index)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.scheduler.add_fork(family[-1], child)
                    family.append(child)
            for member in family:
                rows.append(
                    SamplingRow(
                        params=request.params,
                        prompt_token_ids=member.prompt_token_ids,
                        output_token_ids=member.output_token_ids,
                        generator=member.generator,
                        eos_token_ids=eos_ids,
                    )
                )
                row_seqs.append(member)
                logit_rows.append(logit_row)
        return rows, row_seqs, logit_rows

    @staticmethod
    def _mark_token_time(request: Request, token_time: float) -> None:
        if request.times.first_token is None:
            request.times.first_token = token_time

    def _append_verified(
        self,
        seq: Sequence,
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
        num_accepted: int,
    ) -> None:
        """Append a verified run token by token, so a stop or a length limit inside it ends
        the sequence there; then give back the blocks that only held rejected drafts."""
        self.scheduler.accept_drafts(seq, num_accepted)
        for i, token_id in enumerate(token_ids):
            self._append_token(seq, token_id, None if logprobs is None else logprobs[i])
            if seq.status.is_finished:
                return
        self.scheduler.release_rejected_drafts(seq)

    def _append_token(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None) -> None:
        seq.append_token(token_id)
        params = seq.request.params
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token_id]
        stop_string = seq.detokenizer.add_tokens([token_id]) if seq.detokenizer else None

        status: SequenceStatus | None = None
        num_output = len(seq.output_token_ids)
        if num_output >= params.min_tokens:
            if stop_string is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_string
            elif token_id in params.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token_id
            elif not params.ignore_eos and token_id in self.model_config.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
        if status is None and (
            num_output >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(seq, status)
        if seq.detokenizer is not None:
            seq.emitted_text += seq.detokenizer.take_delta(finished=status is not None)

    # -- outputs ---------------------------------------------------------------------------

    def _make_output(self, request: Request) -> RequestOutput:
        wants_logprobs = request.params.logprobs is not None
        # Finished: lists of its own. Streaming: views of what the sequence holds now.
        snapshot = list if request.finished else GrowingListPrefix
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.emitted_text,
                token_ids=snapshot(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                logprobs=snapshot(seq.logprobs) if wants_logprobs else None,
                finish_reason=seq.status.value if seq.status.is_finished else None,
                stop_reason=seq.stop_reason,
            )
            for seq in request.sequences
        ]
        times = request.times
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs,
            outputs=completions,
            finished=request.finished,
            metrics=RequestMetrics(
                arrival_time=times.arrival, first_scheduled_time=times.first_scheduled,
                first_token_time=times.first_token, finished_time=times.finished,
                spec_decode=None if self.speculator is None else request.spec_stats,
            ),
            num_cached_tokens=request.num_cached_tokens,
        )
