"""The engine core: requests in, steps of schedule -> execute -> update, output deltas and
stats out. Its edges are plain data (messages.py), so it can run in a process of its own;
tokenizing and detokenizing are the front's (llm_engine.py)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.engine.cpu_malloc import retain_freed_memory
from kvserve.engine.dashboard_snapshot import dashboard_snapshot
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.messages import (
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    SequenceDelta,
)
from kvserve.engine.overlap import can_sample_ahead
from kvserve.engine.request import Request
from kvserve.engine.step_timeline import StepTimeline
from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.loader import LoadedModel, load_model, pack_gguf_linears
from kvserve.model_executor.kv_sizing import kv_cache_bytes_per_block
from kvserve.model_executor.model_runner import ModelRunner
from kvserve.model_executor.models.vision_language import encoder_slicing
from kvserve.quantization.batch_invariance import make_batch_invariant
from kvserve.quantization.cpu_plan import (
    AUTO,
    NONE,
    apply_plan,
    gguf_too_large_to_dequantize,
    resolve_auto_quantization,
)
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.speculator import Speculator
from kvserve.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from kvserve.executor.multiproc import MultiprocExecutor
    from kvserve.executor.ray_executor import RayExecutor
    from kvserve.spec_decode.eagle import LoadedEagleHead
    from kvserve.spec_decode.medusa import MedusaHeads
    from kvserve.spec_decode.paged_draft_cache import PagedDraftCache

    # What _load may load beside the target for speculation (before the KV cache is sized:
    # their weights, and an EAGLE head's cache, count against its budget).
    Drafter = LoadedModel | LoadedEagleHead | MedusaHeads

logger = logging.getLogger(__name__)

# Below this hidden size a layer's matmuls are too small for splitting them to pay for the
# all-reduces (vLLM's users report TP slower than one GPU for such models).
SMALL_FOR_TENSOR_PARALLEL = 2048


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
        apply_plan(loaded, plan, pack_linears=pack_gguf_linears)
    if args.resolved_batch_invariant(device):
        layers = make_batch_invariant(loaded.model)
        logger.info("batch-invariant: decode rows of %d quantized layers run their kernels at every batch size, "
                    "prompt rows the dense copies (--no-batch-invariant: the per-batch-size plan)", layers)
    return loaded


class EngineCore:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets several engines (e.g. configurations under comparison) share weights."""
        self.args = args
        self.device = args.resolved_device()
        dtype = args.resolved_dtype(self.device)
        if args.quantization == NONE:
            args = replace(args, quantization=None)
        if args.max_num_batched_tokens is None:
            logger.info(
                "max_num_batched_tokens=%d (per-device default%s)",
                args.resolved_max_num_batched_tokens(self.device),
                ": small prefill chunks on CPU so one step does not hold every stream for seconds"
                if self.device.type == "cpu" else "",
            )
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
            batch_invariant=args.resolved_batch_invariant(self.device),
        )
        self.lora_config = args.lora_config()
        if self.lora_config is not None:
            self.scheduler_config.max_loras = self.lora_config.max_loras
        spec_config = draft = None
        if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
            self.runner = self._parallel_executor(args, loaded)
            self.model_config, self.tokenizer = self.runner.model_config, self.runner.tokenizer
            if self.model_config.is_multimodal:
                self.runner.shutdown()
                raise ValueError(f"{self.model_config.architecture}: vision-language models run on one device "
                                 "(tensor and pipeline parallelism do not split the vision encoder yet)")
            if args.tensor_parallel_size > 1 and self.model_config.hidden_size < SMALL_FOR_TENSOR_PARALLEL:
                logger.warning(
                    "tensor parallelism on a model this small (hidden size %d) likely runs slower than one "
                    "device: each layer waits on two all-reduces that cost more than its share of the "
                    "work saves", self.model_config.hidden_size)
            self.max_model_len = args.max_model_len or self.model_config.max_position_embeddings
        else:
            spec_config, draft, loaded = self._load(args, loaded, dtype)
            self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
            self.max_model_len = args.max_model_len or self.model_config.max_position_embeddings
            self.scheduler_config.encoder_slicing = encoder_slicing(
                self.model_config, args.resolved_encoder_budget_per_step(self.device))
            self.runner = ModelRunner(
                loaded.model, self.model_config, self.cache_config, self.scheduler_config,
                self.device, args.attention_backend, self.max_model_len, args.enforce_eager,
                extra_kv_bytes_per_block=self._draft_kv_bytes_per_block(draft, args.block_size),
                max_draft_tokens=0 if spec_config is None else spec_config.num_speculative_tokens,
                max_verify_batch=None if spec_config is None else spec_config.disable_by_batch_size,
                compile_decode=args.compile_decode, tokenizer=loaded.tokenizer,
                lora_config=self.lora_config,
            )
            # Prompts are cut canonically where the model routes its rows batch-invariantly
            # (a model without quantized layers is not, even when asked).
            self.scheduler_config.batch_invariant = self.runner.batch_invariant
        self._check_max_model_len_fits()
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.scheduler_config, self.kv_cache, self.model_config.eos_token_ids, self.max_model_len
        )
        self.spec_decode_stats: SpecDecodeStats | None = None
        if spec_config is not None:
            self.runner.speculator = self._make_speculator(spec_config, draft)
            self.spec_decode_stats = SpecDecodeStats()
        self.requests: dict[str, Request] = {}
        self.overlap_scheduling = (args.resolved_overlap_scheduling(self.device) and spec_config is None
                                   and args.tensor_parallel_size * args.pipeline_parallel_size == 1)
        self._inflight: list[Sequence] | None = None  # a launched step's sequences, unread
        # Pipeline parallelism: up to one step per stage in flight, oldest first, each as
        # the ids of the sequences it runs (none of which another in-flight step runs).
        self.max_batches_in_flight = args.pipeline_parallel_size
        self._batch_queue: deque[set[str]] = deque()
        self._seqs_in_pipeline: set[str] = set()
        self.most_batches_in_flight = 0  # the most steps that were in the pipeline at once
        self.num_steps = 0
        self.num_steps_ahead = 0
        self.step_timeline = StepTimeline()  # for a watching dashboard only
        logger.info(
            "kvserve engine: %s layers=%d dtype=%s device=%s attention=%s, %d KV blocks (%s) of "
            "%d tokens (%d tokens), max_model_len=%d, overlapped scheduling %s",
            self.model_config.architecture, self.model_config.num_hidden_layers,
            str(dtype).removeprefix("torch."), self.device,
            self.runner.attention_backend_name,
            self.runner.num_blocks,
            str(self.runner.kv_cache_dtype).removeprefix("torch."),
            args.block_size, self.runner.num_blocks * args.block_size, self.max_model_len,
            "on" if self.overlap_scheduling else "off",
        )

    def _load(
        self, args: EngineArgs, loaded: LoadedModel | None, dtype: torch.dtype,
    ) -> tuple[SpeculativeConfig | None, Drafter | None, LoadedModel]:
        """(speculation config, draft model or head, target model) for an engine in one
        process."""
        if loaded is None:
            loaded = load_engine_model(args)
        if self.device.type == "cpu":  # after loading: its transients are not kept
            retain_freed_memory()
        spec_config = draft = None
        if args.speculative_config is not None:
            # Validated and the drafter loaded before the target's cache is sized, so a bad
            # config fails fast, and the drafter's weights and its own KV cache count against
            # the memory budget.
            spec_config = SpeculativeConfig.from_dict(args.speculative_config)
            if spec_config.method == "draft_model":
                from kvserve.spec_decode.draft_model_proposer import load_draft_model

                draft = load_draft_model(spec_config, loaded, dtype, self.device)
            elif spec_config.method in ("eagle", "eagle3"):
                draft = self._load_eagle_head(spec_config, loaded.config)
            elif spec_config.method == "medusa":
                from kvserve.spec_decode.medusa import load_medusa_heads

                draft = load_medusa_heads(spec_config.model, loaded.config, loaded.config.dtype, self.device)
        return spec_config, draft, loaded

    def _load_eagle_head(self, config: SpeculativeConfig, target: ModelConfig) -> LoadedEagleHead:
        from kvserve.spec_decode.eagle import LoadedEagleHead, load_eagle_head

        if config.method == "eagle":
            return LoadedEagleHead(load_eagle_head(config.model, target, target.dtype, self.device))
        from kvserve.spec_decode.eagle3 import load_eagle3_head

        return LoadedEagleHead(*load_eagle3_head(config.model, target, target.dtype, self.device))

    @staticmethod
    def _draft_kv_bytes_per_block(draft: Drafter | None, block_size: int) -> int:
        """What a drafter's own KV cache (as many blocks as the target's) takes a block;
        Medusa heads keep none."""
        if isinstance(draft, LoadedModel):
            return kv_cache_bytes_per_block(draft.config, block_size)
        from kvserve.spec_decode.eagle import LoadedEagleHead, draft_cache_bytes_per_block

        return draft_cache_bytes_per_block(draft.head, block_size) if isinstance(draft, LoadedEagleHead) else 0

    @staticmethod
    def _parallel_executor(args: EngineArgs, loaded: LoadedModel | None) -> MultiprocExecutor | RayExecutor:
        """Workers that load, shard and quantize the model themselves; what one process
        alone can do (a model loaded here, speculation, GGUF blocks kept packed) is refused
        by name."""
        if args.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray; got {args.distributed_executor_backend!r}")
        if loaded is not None:
            raise ValueError("tensor or pipeline parallelism: the workers load the model; pass a model path")
        if args.speculative_config is not None:
            raise ValueError("tensor or pipeline parallelism does not support speculative decoding yet")
        if args.enable_lora:
            raise ValueError("tensor or pipeline parallelism does not support LoRA adapters yet (--enable-lora)")
        if args.quantization == "gguf":
            raise ValueError("tensor or pipeline parallelism cannot split GGUF blocks kept packed (quantization="
                             "'gguf'); use auto, int8 or int4, applied on each rank after sharding")
        if args.pipeline_parallel_size > 1 and args.kv_cache_dtype != "auto":
            raise ValueError("pipeline parallelism does not support a float8 KV cache yet (its scales are "
                             "measured by a forward pass of one process)")
        args = replace(args, compile_decode=False)
        if args.distributed_executor_backend == "ray":
            from kvserve.executor.ray_executor import RayExecutor

            return RayExecutor(args)
        from kvserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(args)

    def _check_max_model_len_fits(self) -> None:
        """One sequence of max_model_len tokens must fit the whole KV cache: otherwise
        every request that leaves max_tokens unset would be refused (vLLM refuses to start)."""
        block_size, num_blocks = self.args.block_size, self.runner.num_blocks
        needed = -(-self.max_model_len // block_size)
        if needed <= num_blocks:
            return
        memory_flag = "--kv-cache-memory" if self.device.type == "cpu" else "--gpu-memory-utilization"
        raise ValueError(
            f"max_model_len ({self.max_model_len} tokens) does not fit the KV cache: one sequence "
            f"of that length needs {needed} blocks of {block_size} tokens, and the cache holds "
            f"{num_blocks} blocks ({num_blocks * block_size} tokens). Raise {memory_flag} (or use "
            f"--kv-cache-dtype fp8), or lower --max-model-len to at most {num_blocks * block_size}."
        )

    def _make_speculator(self, config: SpeculativeConfig, draft: Drafter | None) -> Speculator:
        if config.method == "medusa":
            from kvserve.spec_decode.medusa import MedusaProposer

            proposer = MedusaProposer(draft, config.token_tree(draft.num_heads))
        elif config.method == "eagle":
            from kvserve.spec_decode.eagle import EagleProposer, target_lm_head_drafter

            target, head = self.runner.model, draft.head
            lm_head = target.model.embed_tokens if self.model_config.tie_word_embeddings else target.lm_head
            proposer = EagleProposer(head, target.model.embed_tokens,
                                     target_lm_head_drafter(head, lm_head.weight if target.tp_group is None else None,
                                                            target.compute_logits),
                                     self._eagle_cache(head), config.eagle_tree())
        elif config.method == "eagle3":
            from kvserve.spec_decode.eagle import EagleProposer

            head = draft.head
            self.runner.keep_layer_streams(draft.aux_layers)
            proposer = EagleProposer(head, self.runner.model.model.embed_tokens, head.draft_token_ids,
                                     self._eagle_cache(head), config.eagle_tree())
        elif config.method == "jump_forward":
            from kvserve.spec_decode.jump_forward_proposer import JumpForwardProposer

            step_sampler = self.runner.step_sampler
            proposer = JumpForwardProposer(lambda: step_sampler.grammars)
        elif draft is None:
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

    def _eagle_cache(self, head: torch.nn.Module) -> PagedDraftCache:
        from kvserve.spec_decode.eagle import paged_draft_cache

        # As many blocks as the target's (the KV budget holds both: _draft_kv_bytes_per_block):
        # the head caches no more positions of a sequence than the target does.
        return paged_draft_cache(head, self.runner.num_blocks, self.args.block_size, self.args.attention_backend)

    @property
    def info(self) -> EngineCoreInfo:
        return EngineCoreInfo(
            self.model_config, self.tokenizer, self.max_model_len, self.args.block_size,
            self.runner.num_blocks, self.scheduler_config.max_num_seqs, str(self.device),
            self.runner.kv_cache_dtype, self.runner.attention_backend_name,
            kv_cache_bytes_per_block(self.model_config, self.args.block_size, self.runner.kv_cache_dtype),
            self.runner.decode_weight_bytes, self.runner.expert_weight_bytes, self.lora_config,
        )

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        core_request = Request(
            request.request_id, request.prompt_token_ids, request.params, request.max_tokens,
            request.priority, request.arrival_time, mm_features=request.mm_features,
            lora_request=request.lora_request,
        )
        self.requests[request.request_id] = core_request
        seq = Sequence(f"{request.request_id}#0", core_request, 0)
        core_request.sequences.append(seq)
        self.scheduler.add(seq)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self._finish(request, SequenceStatus.FINISHED_ABORTED)
        self._release_when_idle()

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget a LoRA adapter's weights on the host; requests still running on it finish
        (its device slot is reused only once none runs there)."""
        if self.runner.lora is not None:
            self.runner.lora.remove(lora_int_id)

    def stop_sequences(self, stops: list[tuple[str, int]]) -> None:
        """End samples (request id, index) whose text hit a stop string; a request whose
        samples have all ended is done."""
        for request_id, index in stops:
            request = self.requests.get(request_id)
            if request is None:
                continue
            seq = request.sequences[index]
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            if all(s.status.is_finished for s in request.sequences):
                del self.requests[request_id]
        self._release_when_idle()

    def _release_when_idle(self) -> None:
        """Once nothing runs, the runner forgets what finished now rather than with a next
        step that may not come (a draft model's blocks, seeded generators)."""
        if not self.has_unfinished_requests():
            finished = self.scheduler.step_builder.take_dropped()
            slicer = self.scheduler.encoder_slicer
            cancelled = [] if slicer is None else slicer.take_cancelled()
            if finished or cancelled:
                self.runner.execute(SchedulerOutput(finished_seq_ids=finished, encoder_cancelled=cancelled))

    def _finish(self, request: Request, status: SequenceStatus) -> None:
        for seq in request.sequences:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, status)

    def shutdown(self) -> None:
        """Stop the worker processes, where the model runs in some."""
        self.runner.shutdown()

    def has_unfinished_requests(self) -> bool:
        """Also true while a step is in flight, so that stepping drains it."""
        return bool(self.requests) or self._inflight is not None or bool(self._batch_queue)

    def dead_reason(self) -> str | None:
        """Why no step can run any more (a parallel worker has died), or None."""
        return getattr(self.runner, "dead_reason", None)

    def start_background_work(self) -> None:
        """Deferred start-up work that runs beside the steps: the CPU decode graphs of serve's
        default compile-decode, compiled in a thread while steps run eager."""
        self.runner.compile_in_background(busy=self.has_unfinished_requests)

    def run_idle_work(self) -> bool:
        """One piece of deferred start-up work, for when no request is waiting: a CPU decode
        graph of serve's default compile-decode. Returns whether there was any."""
        return not self.has_unfinished_requests() and self.runner.compile_idle()

    def stats(self) -> SchedulerStats:
        prefix = self.scheduler.prefix_cache_stats
        compiled = self.runner.compiled_decode
        num_running_reqs, num_waiting_reqs = self.scheduler.num_requests()
        pool = self.kv_cache.pool
        # Only a runner in this process keeps an encoder cache (parallel workers run text models).
        encoder_cache = getattr(self.runner, "encoder_cache", None)
        return SchedulerStats(
            num_running_reqs=num_running_reqs,
            num_waiting_reqs=num_waiting_reqs,
            num_running_seqs=len(self.scheduler.running),
            num_waiting_seqs=len(self.scheduler.waiting),
            num_unfinished_requests=len(self.requests),
            kv_cache_usage=self.kv_cache.usage,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_cached_evictable_blocks,
            kv_blocks_shared=pool.num_shared_blocks,
            kv_shared_references=pool.num_references - pool.num_used_blocks,
            kv_slots_unused=self.kv_cache.num_unused_slots(
                {seq.seq_id: seq.num_computed_tokens for seq in self.scheduler.running}),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=prefix.queried_tokens,
            prefix_cache_hits=prefix.hit_tokens,
            decode_graphs_pending=0 if compiled is None else compiled.pending,
            num_steps=self.num_steps,
            num_steps_ahead=self.num_steps_ahead,
            spec_decode=self.spec_decode_stats,
            num_images_encoded=0 if encoder_cache is None else encoder_cache.num_images_encoded,
            encoder_seconds=0.0 if encoder_cache is None else encoder_cache.encoder_seconds,
            lora_requests={} if self.lora_config is None else self.scheduler.lora_requests(),
        )

    def dashboard_snapshot(self) -> dict:
        """The block map, queues and steps a live dashboard shows (dashboard_snapshot.py)."""
        return dashboard_snapshot(self.scheduler, self.step_timeline, self.stats(), self.info)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule -> execute -> update. With overlapped scheduling a decode step's
        tokens are read one call later: the call launches the next step first (see
        kvserve/engine/overlap.py). With pipeline stages, see _step_pipelined."""
        if self.max_batches_in_flight > 1:
            return self._step_pipelined()
        if self._inflight is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                self.scheduler.step_builder.put_back_dropped(sched.finished_seq_ids)
                return EngineCoreOutputs(stats=self.stats())
            seqs = self.scheduler.scheduled(sched)
            if self.step_timeline.watched:
                self.step_timeline.record(((seq, sched.num_scheduled_tokens[seq.seq_id]) for seq in seqs),
                                          len(sched.preempted_seq_ids))
            first_scheduled = self._note_scheduled(seqs)
            if not self._can_defer(sched, seqs):
                runner_output = self.runner.execute(sched)
                self.scheduler.advance(sched)
                outputs = self._update(runner_output)
                outputs.first_scheduled = first_scheduled
                return outputs
            self.runner.launch(sched)
            self.scheduler.advance(sched)
            self._inflight = seqs
        inflight = self._inflight
        self._inflight = self._launch_ahead(inflight)
        return self._update(self.runner.collect(), inputs_were_in_flight=True)

    def _step_pipelined(self) -> EngineCoreOutputs:
        """A step of pipeline parallelism: while fewer steps than stages are in flight,
        submit one more (of sequences no in-flight step runs) and return, so that stage 0
        starts it while later stages still run the earlier ones; otherwise (or when nothing
        more can be scheduled) wait for the oldest step's output and apply it."""
        first_scheduled: dict[str, tuple[float, int]] = {}
        if len(self._batch_queue) < self.max_batches_in_flight:
            sched = self.scheduler.schedule(self._seqs_in_pipeline)
            if sched.is_empty:
                self.scheduler.step_builder.put_back_dropped(sched.finished_seq_ids)
            else:
                first_scheduled = self._note_scheduled(self.scheduler.scheduled(sched))
                self.runner.submit(sched)
                self.scheduler.advance(sched)
                # A prompt's forked samples take their first tokens from this step too.
                seq_ids = set(sched.num_scheduled_tokens).union(
                    *({child for child, _ in forks} for forks in sched.forks.values()))
                self._batch_queue.append(seq_ids)
                self._seqs_in_pipeline |= seq_ids
                self.most_batches_in_flight = max(self.most_batches_in_flight, len(self._batch_queue))
                if len(self._batch_queue) < self.max_batches_in_flight:
                    return EngineCoreOutputs(first_scheduled=first_scheduled, stats=self.stats())
        if not self._batch_queue:
            return EngineCoreOutputs(stats=self.stats())
        self._seqs_in_pipeline -= self._batch_queue.popleft()
        outputs = self._update(self.runner.receive())
        outputs.first_scheduled = first_scheduled
        return outputs

    def _note_scheduled(self, seqs: list[Sequence]) -> dict[str, tuple[float, int]]:
        now = time.time()
        first = {}
        for seq in seqs:
            request = seq.request
            if not request.scheduled:
                request.scheduled = True
                first[request.request_id] = (now, seq.num_computed_tokens)
        return first

    def _can_defer(self, sched: SchedulerOutput, seqs: list[Sequence]) -> bool:
        """A step whose tokens may be read later: every sequence decodes one token and can
        be sampled ahead."""
        return self.overlap_scheduling and bool(seqs) and not sched.encoder_slices and all(
            sched.num_scheduled_tokens[seq.seq_id] == 1
            and seq.num_computed_tokens + 1 == seq.num_tokens
            and can_sample_ahead(seq)
            for seq in seqs
        )

    def _launch_ahead(self, inflight: list[Sequence]) -> list[Sequence] | None:
        """The next decode step of the in-flight step's sequences, fed its sampled ids on
        the device; None when it must wait for the host (requests waiting for admission,
        too few free blocks, nothing left to run)."""
        seqs = []
        for seq in inflight:
            if seq.status is not SequenceStatus.RUNNING or self._ends_at_inflight_token(seq):
                continue
            if not can_sample_ahead(seq):
                return None
            seqs.append(seq)
        if not seqs:
            return None
        sched = self.scheduler.schedule_ahead(seqs)
        if sched is None:
            return None
        if self.step_timeline.watched:
            self.step_timeline.record(((seq, 1) for seq in seqs), 0)
        self.runner.launch(sched)
        self.scheduler.advance(sched)
        self.num_steps_ahead += 1
        return seqs

    def _ends_at_inflight_token(self, seq: Sequence) -> bool:
        """Whether the token in flight is certainly the sequence's last (length limits)."""
        return (
            len(seq.output_token_ids) + 1 >= seq.request.max_tokens
            or seq.num_tokens + 1 >= self.max_model_len
        )

    def _fail(self, failed: dict[str, str], outputs: EngineCoreOutputs) -> None:
        """End the requests of sequences whose sampling raised (or whose LoRA adapter could not
        be read), and only those."""
        for seq_id, error in failed.items():
            seq = self.scheduler.seqs.get(seq_id)
            request = None if seq is None else self.requests.pop(seq.request.request_id, None)
            if request is None:
                continue  # a sibling sample failed too
            logger.warning("request %s failed: %s", request.request_id, error)
            self._finish(request, SequenceStatus.FINISHED_ABORTED)
            outputs.failed_requests[request.request_id] = error

    def _update(self, runner_output: ModelRunnerOutput, inputs_were_in_flight: bool = False) -> EngineCoreOutputs:
        self.num_steps += 1
        outputs = EngineCoreOutputs()
        for seq_id, first_target, entries in runner_output.prompt_logprobs:
            request = self.scheduler.seqs[seq_id].request
            if first_target < request.num_prompt_logprobs:
                continue  # recomputed after a preemption: already sent
            request.num_prompt_logprobs += len(entries)
            outputs.prompt_logprobs.setdefault(request.request_id, []).extend(entries)
        self._fail(runner_output.failed, outputs)
        touched: dict[str, Request] = {}
        for update in self.scheduler.update_from_output(runner_output, inputs_were_in_flight):
            seq, request = update.seq, update.seq.request
            if update.num_drafts:
                self.spec_decode_stats.observe(update.num_drafts, update.num_accepted)
            outputs.deltas.append(SequenceDelta(
                request.request_id, seq.index, update.token_ids, update.logprobs,
                seq.status.value if seq.status.is_finished else None, seq.stop_reason,
                update.num_drafts, update.num_accepted,
            ))
            touched[request.request_id] = request
        for request_id, request in touched.items():
            if all(seq.status.is_finished for seq in request.sequences):
                del self.requests[request_id]
                outputs.finished_requests.append(request_id)
        self._release_when_idle()
        outputs.stats = self.stats()
        return outputs
