"""Turns the scheduler's decision into one flattened batch and runs the model on it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.selector import get_attn_backend
from kvserve.attention.torch_ref import FLOAT8_DTYPES, as_storage
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.core.sched.output import ModelRunnerOutput, SampledSequence, SchedulerOutput
from kvserve.lora.config import LoRAConfig
from kvserve.lora.slots import LoRASlots
from kvserve.model_executor.compiled_decode import MAX_ROWS as MAX_COMPILED_ROWS
from kvserve.model_executor.compiled_decode import CompiledDecode
from kvserve.model_executor.block_tables import BlockTable, pack_block_tables
from kvserve.model_executor.encoder_cache import EncoderCache
from kvserve.model_executor.sliced_encoder import SlicedEncoder
from kvserve.model_executor.inflight import InflightStep
from kvserve.model_executor.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    blocks_in_budget,
    kv_cache_bytes_per_block,
)
from kvserve.model_executor.model_bytes import expert_weight_bytes, weight_bytes_per_step
from kvserve.model_executor.input_batch import RunnerSequence, SequenceStates
from kvserve.multimodal.inputs import ImageFeature
from kvserve.multimodal.processing import mrope_positions
from kvserve.model_executor.cuda_graphs import CudaGraphRunner
from kvserve.model_executor.step_sampler import StepSampler
from kvserve.ops.argmax import row_argmax
from kvserve.ops.cpu import float_matmul_op
from kvserve.quantization.base import QuantizedLinear
from kvserve.quantization.batch_invariance import routed_rows, row_runs
from kvserve.spec_decode.speculator import Speculator
from kvserve.spec_decode.tree import tree_attention_mask, tree_depths, tree_step_inputs
from kvserve.utils import lazy_zeros

logger = logging.getLogger(__name__)

# A background compile waits for this long without requests before it starts a graph: a
# request that comes right after start-up runs at full eager speed.
IDLE_BEFORE_COMPILE_S = 0.5
# How long a background compile pauses for requests, at most, in each graph.
MAX_PAUSE_PER_GRAPH_S = 20.0

# float8 KV scales: measured on this many random tokens, with this much room above the
# largest |K| and |V| seen (real text can exceed what random tokens produce; beyond the
# room values saturate). Within the normal range float8's relative precision does not
# depend on the scale, so room costs nothing until the smallest values turn subnormal.
KV_CALIBRATION_TOKENS = 512
KV_SCALE_HEADROOM = 4.0
# Vision encoder outputs kept for reuse: at least this many embedding rows (a few large
# images), or a step's token budget if that is more.
MIN_ENCODER_CACHE_TOKENS = 16384


@dataclass
class ImageSpan:
    """Placeholder tokens of one image that a step computes: flat rows of the batch and
    the rows of the image's embeddings they take."""

    feature: ImageFeature
    flat_start: int
    first_row: int
    num_rows: int


@dataclass
class StepLogits:
    """Logits of one forward pass, for the positions the step samples or scores."""

    # [R, V] fp32: next-token logits of each sequence that samples this step, in
    # sampling_seq_ids order: one row, or 1 + k for a sequence verifying k drafts (the last
    # verified token and each draft predict the token after them).
    sample_logits: torch.Tensor
    sampling_seq_ids: list[str]
    num_sample_rows: list[int]
    # (sequence id, [P, V] logits, index of the first prompt token they predict): prompt
    # positions of this chunk, for requests that asked for prompt logprobs.
    prompt_logits: list[tuple[str, torch.Tensor, int]]
    # [R, H] the last layer's hidden states at sample_logits' rows, for draft heads that read
    # them (None unless the speculator needs them).
    sample_hidden: torch.Tensor | None = None
    # [T, H] every row's (the step's order), for drafters that read them all (EAGLE); with
    # aux_hidden_layers, [T, 3H]: the residual streams entering those layers (EAGLE-3).
    step_hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        attention_backend: str = "auto",
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        extra_kv_bytes_per_block: int = 0,
        max_draft_tokens: int = 0,
        max_verify_batch: int | None = None,
        compile_decode: bool | None = False,
        tokenizer=None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """`extra_kv_bytes_per_block`: another cache sized in the same number of blocks
        (a speculative draft model's) that the KV memory budget must also hold.
        `max_draft_tokens`: speculative drafts a sequence may verify in one step, so that
        verify steps replay CUDA graphs too; `max_verify_batch`: the most sequences a verify
        step has (None: max_num_seqs), whose graphs are captured at start.
        `compile_decode`: run CPU decode steps through a torch.compile'd graph
        (compiled_decode.py), compiled here; None: where supported, its graphs compiled by
        `compile_idle` (steps run eager until theirs is ready). `tokenizer`: the vocabulary
        of structured outputs' grammars. `lora_config`: serve LoRA adapters (the model's
        linears are wrapped in LoRALinear; their slots are allocated before the KV cache is
        sized, so on a GPU the memory profile counts them)."""
        self.model = model
        # Quantized layers made batch-invariant (load_engine_model): each step names its
        # prompt rows, which take the dense path, and its decode rows, the kernels.
        self.batch_invariant = any(isinstance(m, QuantizedLinear) and m.batch_invariant for m in model.modules())
        self.attn_backend = get_attn_backend(
            device, attention_backend, model_config.sliding_window
        )
        model.set_attn_backend(self.attn_backend)
        model.pack_experts()
        if device.type == "cpu":
            # The fp32 linears' and LM head's kernel: built (once per machine) before the first request.
            float_matmul_op()
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        self.block_size = cache_config.block_size
        self.kv_cache_dtype = cache_config.kv_cache_dtype or model_config.dtype
        self._check_kv_cache_dtype()
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block
        self.lora: LoRASlots | None = None
        # Sequences whose LoRA adapter could not be read this step (id -> the error): they run
        # on the base model and their requests fail (ModelRunnerOutput.failed).
        self._lora_failures: dict[str, str] = {}
        if lora_config is not None:
            max_tokens = max(scheduler_config.max_num_batched_tokens,
                             scheduler_config.max_num_seqs * (1 + max_draft_tokens))
            self.lora = LoRASlots(model, model_config, lora_config, max_tokens, device)
            logger.info("LoRA: %d slots of rank %d on %d linears (%.1f MiB), %d adapters kept on the host",
                        lora_config.max_loras, lora_config.max_lora_rank, len(self.lora.layers),
                        self.lora.slot_bytes / 2**20, lora_config.host_capacity)
        if cache_config.num_blocks is None:
            cache_config.num_blocks = self._determine_num_blocks()
        self.num_blocks = cache_config.num_blocks
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.seqs = SequenceStates()
        self.step_sampler = StepSampler(device, model_config.eos_token_ids, max_model_len,
                                        tokenizer, model_config.vocab_size)
        self.speculator: Speculator | None = None  # set by the engine when it speculates
        # Layers whose entering residual stream every step keeps for the drafter (EAGLE-3;
        # keep_layer_streams): CUDA-graph steps run eager, the compiled CPU step returns them.
        self.aux_hidden_layers: tuple[int, ...] = ()
        self._inflight: deque[InflightStep] = deque()
        # The scales belong to this runner's cache (weights may be shared with other engines).
        for layer in model.model.layers:
            layer.self_attn.kv_scales = (1.0, 1.0)
        if self.kv_cache_dtype in FLOAT8_DTYPES:
            self._calibrate_kv_scales()
        if self._triton_attention():
            # Every attention variant compiled now, not inside the first requests that need one.
            self.attn_backend.warm_up(self.kv_caches[0], model_config.num_attention_heads, model_config.dtype,
                                      self.block_size, max_width=1 + max_draft_tokens)
        if device.type == "cuda":  # the sampler's argmax kernels likewise (fp32 logits)
            row_argmax(torch.zeros(1, model.config.vocab_size, device=device))
        self.cuda_graphs = None
        if self._can_use_cuda_graphs(enforce_eager):
            max_len = max_model_len or model_config.max_position_embeddings
            self.cuda_graphs = CudaGraphRunner(
                model, self.kv_caches, self.block_size, scheduler_config.max_num_seqs,
                -(-max_len // self.block_size), device, max_width=1 + max_draft_tokens,
                max_verify_batch=max_verify_batch,
            )
            self.cuda_graphs.capture_all()
        self._compile_thread: threading.Thread | None = None
        self.compiled_decode = self._compiled_decode(compile_decode)
        self.encoder_cache = EncoderCache(
            max(MIN_ENCODER_CACHE_TOKENS, scheduler_config.max_num_batched_tokens))
        self.sliced_encoder = SlicedEncoder(self.encoder_cache)

    def keep_layer_streams(self, layers: tuple[int, ...]) -> None:
        """Every step keeps the residual streams entering `layers` for the drafter (EAGLE-3):
        StepLogits.step_hidden holds them side by side."""
        self.aux_hidden_layers = layers
        if self.compiled_decode is not None:
            compiled_now = not self.compiled_decode.pending  # compile_decode=True: compiled before serving
            self.compiled_decode.keep_streams(layers)
            if compiled_now:
                self.compiled_decode.warm_up()

    def _compiled_decode(self, compile_decode: bool | None) -> CompiledDecode | None:
        """The compiled CPU decode step: compiled now for an explicit True (which raises if
        compiling fails); for None (the serve default) where it applies, its graphs left to
        `compile_idle`, except in batch-invariant mode, which compiles them now: a step
        before its graph is ready would run eager, and a graph's results differ from eager
        ones in the low bits (a compile that fails leaves every step eager)."""
        supported = CompiledDecode.supports(self.model, self.kv_caches, self.device)
        if compile_decode is False or (compile_decode is None and not supported):
            return None
        if not supported:
            raise ValueError(
                "--compile-decode needs the CPU, the torch attention backend, a KV cache "
                "that is not float8 and, in a mixture of experts, unquantized experts all on this rank"
            )
        compiled = CompiledDecode(self.model, self.kv_caches, self.model_config.sliding_window)
        if compile_decode or self.batch_invariant:
            logger.info("compile-decode: compiling %d graphs (%s) before serving%s, ~10-15 s each on 2 cores "
                        "(~1 min each the first time)", compiled.pending, ", ".join(compiled.bands()),
                        " (batch-invariant: every decode step runs a graph)" if self.batch_invariant else "")
            try:
                compiled.warm_up()
            except Exception as error:
                if compile_decode:
                    raise
                logger.warning("compile-decode: compiling failed, decode steps run eager: %s", error)
                return None
        else:
            logger.info("compile-decode: on by default for CPU serving: %d decode graphs (%s) compile while "
                        "the engine is idle (a server: in the background), ~10-15 s each on 2 cores (~1 min "
                        "each the first time); until its graph is ready a step runs eager "
                        "(--no-compile-decode: eager only)", compiled.pending,
                        ", ".join(compiled.bands()))
        return compiled

    def compile_in_background(self, busy: Callable[[], bool]) -> None:
        """Compile the pending decode graphs in a thread of their own while steps run: a step
        runs eager until its batch band's graph is ready, so no request waits for a compile
        (what `kvserve serve` does). Dynamo's tracing shares the interpreter with the step
        loop and would slow eager steps several times over, so the compile yields to them: a
        graph starts once the engine has not been `busy` for IDLE_BEFORE_COMPILE_S, and
        pauses while it is, for up to MAX_PAUSE_PER_GRAPH_S a graph (then it finishes beside
        the steps: a sustained load, or a step that waits for Dynamo's compile lock, never
        holds it back for long)."""
        if self._compile_thread is not None or self.compiled_decode is None or not self.compiled_decode.pending:
            return
        calls, paused = 0, 0.0

        def pause_while_busy(*_: object) -> None:
            # A profile hook of this thread alone, checked every few thousand Python calls
            # of the compile.
            nonlocal calls, paused
            calls += 1
            if calls % 4096 or paused >= MAX_PAUSE_PER_GRAPH_S:
                return
            start = time.monotonic()
            while busy() and paused + time.monotonic() - start < MAX_PAUSE_PER_GRAPH_S:
                time.sleep(0.002)
            paused += time.monotonic() - start

        def compile_all() -> None:
            nonlocal paused
            quiet_since = time.monotonic()
            while self.compiled_decode is not None and self.compiled_decode.pending:
                if busy():
                    quiet_since = time.monotonic()
                if time.monotonic() - quiet_since < IDLE_BEFORE_COMPILE_S:
                    time.sleep(0.05)
                    continue
                paused = 0.0
                sys.setprofile(pause_while_busy)
                try:
                    self.compile_idle()
                finally:
                    sys.setprofile(None)

        self._compile_thread = threading.Thread(target=compile_all, name="kvserve-compile-decode", daemon=True)
        self._compile_thread.start()

    def compile_idle(self) -> bool:
        """Compile the next pending decode graph (compile_decode=None), if any: what the
        engine does while it has no requests. A failed compile (e.g. no C++ compiler for
        inductor) leaves decode steps eager. Returns whether a compile was attempted."""
        if self.compiled_decode is None or not self.compiled_decode.pending:
            return False
        try:
            self.compiled_decode.compile_next()
        except Exception as error:
            logger.warning("compile-decode: compiling failed, decode steps run eager: %s", error)
            self.compiled_decode = None
        return True

    def _can_use_cuda_graphs(self, enforce_eager: bool) -> bool:
        """Only the Triton backend launches from device-side metadata alone; the torch
        reference loops over host copies of it, which a replay would not update."""
        return not enforce_eager and self._triton_attention() and self.model.graph_capturable

    def _triton_attention(self) -> bool:
        if self.device.type != "cuda":
            return False
        from kvserve.attention.triton_backend import TritonAttentionBackend

        return isinstance(self.attn_backend, TritonAttentionBackend)

    def _check_kv_cache_dtype(self) -> None:
        """float8 storage needs float8 conversions on the device: compute capability 8.9+."""
        if self.kv_cache_dtype not in FLOAT8_DTYPES or self.device.type != "cuda":
            return
        capability = torch.cuda.get_device_capability(self.device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype} needs a GPU of compute capability 8.9 "
                f"or newer (Ada, Hopper); this one is {capability[0]}.{capability[1]}. Use "
                "--kv-cache-dtype auto."
            )

    @torch.inference_mode()
    def _calibrate_kv_scales(self) -> None:
        """Per-layer scales of a float8 cache: a forward of random tokens into a cache of
        the model's dtype, each layer's largest |K| (in the rotated basis the float8 cache
        stores keys in) and |V|, times the headroom, mapped to the float8 maximum."""
        config = self.model_config
        num_tokens = min(KV_CALIBRATION_TOKENS, self.scheduler_config.max_num_batched_tokens)
        num_blocks = -(-num_tokens // self.block_size)
        shape = (2, num_blocks, self.block_size, config.num_key_value_heads, config.head_dim)
        caches = [torch.zeros(shape, dtype=config.dtype, device=self.device)
                  for _ in range(config.num_hidden_layers)]
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(config.vocab_size, (num_tokens,), generator=generator)
        positions = torch.arange(num_tokens, device=self.device)
        metadata = self._metadata(positions, [0, num_tokens], [num_tokens],
                                  [list(range(num_blocks))])
        self.model(input_ids.to(self.device), positions, caches, metadata)
        fp8_max = torch.finfo(self.kv_cache_dtype).max
        scales = []
        for layer, cache in zip(self.model.model.layers, caches, strict=True):
            keys, values = cache.float()
            amax = torch.stack([self.attn_backend.to_key_basis(keys).abs().amax(), values.abs().amax()])
            k_scale, v_scale = (amax.clamp_min(1e-6) * KV_SCALE_HEADROOM / fp8_max).tolist()
            layer.self_attn.kv_scales = (k_scale, v_scale)
            scales += [k_scale, v_scale]
        logger.info(
            "%s KV cache: per-layer scales %.2e..%.2e from %d random tokens",
            str(self.kv_cache_dtype).removeprefix("torch."), min(scales), max(scales), num_tokens,
        )

    @property
    def attention_backend_name(self) -> str:
        return type(self.attn_backend).__name__

    @property
    def decode_weight_bytes(self) -> int:
        """What a batch-1 decode step reads of the weights (its bandwidth floor)."""
        return weight_bytes_per_step(self.model, self.model_config)

    @property
    def expert_weight_bytes(self) -> int:
        """All experts of a mixture (how the bytes a step reads grow with the batch)."""
        return expert_weight_bytes(self.model)

    def shutdown(self) -> None:
        """Nothing of a runner lives outside this process (an executor's workers do)."""

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Hold `num_blocks` blocks instead (tensor-parallel ranks agree on the smallest)."""
        if num_blocks != self.num_blocks:
            self.kv_caches = []
            self.kv_caches = self._allocate_kv_caches(num_blocks)
            self.num_blocks = self.cache_config.num_blocks = num_blocks

    # -- memory ----------------------------------------------------------------------------

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """A [2, blocks, block_size, kv_heads, head_dim] cache per layer. On CPU all are views
        of one tensor: the compiled decode writes every layer's new keys and values in one
        copy. On GPUs each layer has its own: one tensor of the whole budget could not reuse
        the allocator's segments freed after the memory profile (an H100 llama3-8b run then
        ran out of memory with 7 GiB reserved and unused)."""
        config = self.model_config
        shape = (2, num_blocks, self.block_size, config.num_key_value_heads, config.head_dim)
        if self.device.type == "cpu":
            return list(lazy_zeros((config.num_hidden_layers, *shape), self.kv_cache_dtype).unbind(0))
        return [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]

    def _determine_num_blocks(self) -> int:
        bytes_per_block = (
            kv_cache_bytes_per_block(self.model_config, self.block_size, self.kv_cache_dtype)
            + self.extra_kv_bytes_per_block
        )
        if self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
            if self.cache_config.kv_cache_memory is not None:  # a size given: it, if it fits
                if self.cache_config.kv_cache_memory > budget:
                    raise ValueError(
                        f"kv_cache_memory {self.cache_config.kv_cache_memory / 2**30:.2f} GiB does not fit: "
                        f"{budget / 2**30:.2f} GiB is free for the KV cache at gpu_memory_utilization "
                        f"{self.cache_config.gpu_memory_utilization}")
                budget = self.cache_config.kv_cache_memory
        else:
            budget = self.cache_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
        return blocks_in_budget(budget, bytes_per_block, self.block_size)

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step the scheduler may build and give what is left to the KV cache."""
        num_tokens = self.scheduler_config.max_num_batched_tokens
        num_profile_blocks = -(-num_tokens // self.block_size)
        caches = self._allocate_kv_caches(num_profile_blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        metadata = self._metadata(
            positions, query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
            block_tables=[list(range(num_profile_blocks))],
        )
        hidden = self.model(input_ids, positions, caches, metadata)
        num_sampled = min(self.scheduler_config.max_num_seqs, num_tokens)
        if self.model.is_last_stage:
            self.model.compute_logits(hidden[:num_sampled])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        cache_bytes = sum(cache.numel() * cache.element_size() for cache in caches)
        del caches, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        activations = peak - cache_bytes - torch.cuda.memory_allocated(self.device)
        # What the driver counts as used, not what torch allocated: besides the weights it
        # holds the CUDA context and the allocator's segments that live tensors keep from
        # being released (a model quantized on the GPU leaves holes where its float weights
        # were, which KV tensors of a few GiB cannot use).
        budget = int(total * self.cache_config.gpu_memory_utilization) - (total - free) - activations
        logger.info(
            "GPU memory: total %.2f GiB, weights+activations peak %.2f GiB, KV budget %.2f GiB",
            total / 2**30, (peak - cache_bytes) / 2**30, budget / 2**30,
        )
        if budget <= 0:
            raise ValueError(
                f"The model and a {num_tokens}-token step need {(peak - cache_bytes) / 2**30:.2f} "
                f"GiB, more than gpu_memory_utilization={self.cache_config.gpu_memory_utilization} "
                f"of {total / 2**30:.2f} GiB leaves; lower --max-num-batched-tokens or raise "
                "--gpu-memory-utilization."
            )
        return budget

    # -- one step --------------------------------------------------------------------------

    def _metadata(
        self,
        positions: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: list[BlockTable],
        slot_positions: torch.Tensor | None = None,
        tree_masks: dict[int, torch.Tensor] | None = None,
    ) -> AttentionMetadata:
        """`slot_positions`: where each token's K/V goes, when it differs from its RoPE
        position (token-tree drafts); defaults to `positions`."""
        if slot_positions is None:
            slot_positions = positions
        query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        block_tables_t = pack_block_tables(block_tables).to(self.device)
        # Each token's cache slot: its sequence's block for the position, plus the offset.
        # output_size is known on the host; without it the GPU would sync to learn it.
        seq_index = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=self.device),
            torch.tensor(query_lens, device=self.device),
            output_size=positions.numel(),
        )
        block_ids = block_tables_t[seq_index, slot_positions // self.block_size].long()
        return AttentionMetadata(
            slot_mapping=block_ids * self.block_size + slot_positions % self.block_size,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=block_tables_t,
            block_size=self.block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            tree_masks=tree_masks,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache = as_storage(cache)
            cache[:, dst] = cache[:, src]

    def _graph_can_run(self, sched: SchedulerOutput) -> bool:
        """Whether the step is a decode or a chain verify step that a CUDA graph can run:
        every sequence feeds its newest token plus drafts and samples at each (so none is
        inside its prompt, where prompt logprobs would be wanted)."""
        width = 0
        for seq_id, num in sched.num_scheduled_tokens.items():
            seq = self.seqs[seq_id]
            if (
                seq.num_computed_tokens + 1 != seq.num_tokens
                or num > 1 + len(sched.spec_token_ids.get(seq_id, ()))
            ):
                return False
            width = max(width, num)
        return width > 0 and self.cuda_graphs.can_run(len(sched.num_scheduled_tokens), width)

    def _execute_graph(self, sched: SchedulerOutput) -> StepLogits:
        seq_ids = sched.scheduled_seq_ids
        seqs = [self.seqs[seq_id] for seq_id in seq_ids]
        num_rows = list(sched.num_scheduled_tokens.values())
        self._copy_blocks(sched.block_copies)
        if self.lora is not None:  # each sequence's rows are padded to the step's width
            self.lora.set_tokens([seq.lora_int_id for seq in seqs], [max(num_rows)] * len(seqs))
        logits = self.cuda_graphs.run(
            [[seq.token_ids[-1], *sched.spec_token_ids.get(seq_id, ())[: n - 1]]
             for seq_id, seq, n in zip(seq_ids, seqs, num_rows)],
            [seq.num_computed_tokens for seq in seqs],
            [seq.block_ids for seq in seqs],
            rope_offsets=self._rope_offsets(seqs),
            trees=[self._graph_tree(seq, sched.spec_tree_parents.get(seq_id), n)
                   for seq_id, seq, n in zip(seq_ids, seqs, num_rows)] if sched.spec_tree_parents else None,
        )
        if self.speculator is not None and self.speculator.needs_hidden_states:
            # Every row of a graph step samples: the sampled rows are all of the step's.
            hidden = self.cuda_graphs.last_hidden()
            # A view of the graph's buffer, which the next replay overwrites: EAGLE keeps the
            # features of a sequence that does not draft this step until it does (one copy a
            # step, not one a sequence; none where the batch is too large to speculate).
            keeps = self.speculator.reads_step_features and self.speculator.speculates_at(len(seq_ids))
            step_hidden = hidden.clone() if keeps else hidden
            return StepLogits(logits, seq_ids, num_rows, [], hidden, step_hidden)
        return StepLogits(logits, seq_ids, num_rows, [])

    @staticmethod
    def _graph_tree(seq: RunnerSequence, parents: list[int] | None, num_rows: int
                    ) -> tuple[list[int], list[int]] | None:
        """A tree verify row group's (rotary positions, visibility bits) for the graphs: the
        newest token then its drafts, which rotate by depth; None for a chain."""
        if parents is None or num_rows == 1:
            return None
        return tree_step_inputs(seq.num_computed_tokens, parents[: num_rows - 1])

    def _apply(self, sched: SchedulerOutput) -> None:
        """Bring the held sequences up to date; forget the sampling and drafting state of
        those that are gone."""
        self.seqs.apply(sched)
        if self.lora is not None:
            adapters = {new.lora_request.lora_int_id: new.lora_request for new in sched.new_seqs if new.lora_request}
            if adapters:
                failed = self.lora.activate(adapters.values(), {seq.lora_int_id for seq in self.seqs.values()})
                self._lora_failures = {new.seq_id: failed[new.lora_request.lora_int_id] for new in sched.new_seqs
                                       if new.lora_request and new.lora_request.lora_int_id in failed}
        self.step_sampler.prepare(sched)
        if sched.finished_seq_ids:
            self.step_sampler.forget(sched.finished_seq_ids)
        if self.speculator is not None and (sched.finished_seq_ids or sched.preempted_seq_ids):
            self.speculator.retain(self.seqs)
        self.sliced_encoder.cancel(sched.encoder_cancelled)
        if sched.encoder_slices:  # before the forward: a step may prefill an image its slice finishes
            self.sliced_encoder.run(sched.encoder_slices, self.model, self._device_sync)

    def _device_sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- a step with its sampling ----------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step and sample it; returns once the tokens are on the host. A step
        that schedules no tokens only says what finished and runs its encoder slices."""
        if not sched.num_scheduled_tokens:
            self._apply(sched)
            return ModelRunnerOutput(encoder_evicted=self.encoder_cache.take_evicted())
        logits = self.forward(sched)
        output = self.step_sampler.sample(
            sched, self.seqs, logits.sample_logits, logits.sampling_seq_ids,
            logits.num_sample_rows, logits.prompt_logits, self.speculator, logits.sample_hidden,
            logits.step_hidden,
        )
        if self._lora_failures:
            output.failed.update(self._lora_failures)
            self._lora_failures = {}
        output.encoder_evicted = self.encoder_cache.take_evicted()
        return output

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> None:
        """Run a decode step whose sampled ids stay on the device until `collect` (the
        next step may take them as inputs: sched.inputs_in_flight). Only steps whose
        sampling needs none of the host's lagging state are launched (no logprobs,
        penalties or min_tokens bans, no drafts)."""
        seq_ids = sched.scheduled_seq_ids
        previous = self._inflight[-1] if sched.inputs_in_flight else None
        if previous is not None:
            logits = self.forward_ahead(sched, previous.inputs_for(seq_ids))
        else:
            logits = self.forward(sched).sample_logits
        token_ids = self.step_sampler.sample_ids(logits, seq_ids, self.seqs, previous)
        self._inflight.append(InflightStep.start(seq_ids, token_ids))

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest launched step, waiting for that step only."""
        step = self._inflight.popleft()
        return ModelRunnerOutput(
            [SampledSequence(seq_id, [token_id]) for seq_id, token_id in zip(step.seq_ids, step.read())]
        )

    # -- forward passes --------------------------------------------------------------------

    @torch.inference_mode()
    def forward_ahead(self, sched: SchedulerOutput, token_ids: torch.Tensor) -> torch.Tensor:
        """A decode step launched before the host has read its input tokens: the i-th
        scheduled sequence feeds token_ids[i] (on the device, sampled by the step still in
        flight) at its num_computed_tokens. Returns next-token logits [B, V] fp32."""
        self._apply(sched)
        seqs = [self.seqs[seq_id] for seq_id in sched.num_scheduled_tokens]
        positions = [seq.num_computed_tokens for seq in seqs]
        tables = [seq.block_ids for seq in seqs]
        self._copy_blocks(sched.block_copies)
        if self.lora is not None:
            self.lora.set_tokens([seq.lora_int_id for seq in seqs], [1] * len(seqs))
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(len(seqs)):
            return self.cuda_graphs.run([[0]] * len(seqs), positions, tables, token_ids, self._rope_offsets(seqs))
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        metadata = self._metadata(
            positions_t, list(range(len(seqs) + 1)), [p + 1 for p in positions], tables
        )
        if self.model_config.mrope_section:
            positions_t = torch.cat([self._mrope_positions(seq, [p]) for seq, p in zip(seqs, positions)],
                                    dim=1).to(self.device)
        hidden = self.model(token_ids, positions_t, self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> StepLogits:
        """The step's forward pass: logits of the positions that sample or score."""
        self._apply(sched)
        if self.cuda_graphs is not None and self._graph_can_run(sched) and not self.aux_hidden_layers:
            return self._execute_graph(sched)
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[BlockTable] = []
        sample_indices: list[int] = []
        sampling_seq_ids: list[str] = []
        num_sample_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int, int]] = []  # seq id, flat start, count, pos
        tree_masks: dict[int, torch.Tensor] = {}
        rope_positions: list[int] = []  # differ from positions only for token trees
        image_spans: list[ImageSpan] = []
        mrope_chunks: list[torch.Tensor] = []
        row_kinds: list[tuple[int, bool]] = []  # (rows, decode) per sequence, for batch invariance

        for seq_id, num_new in sched.num_scheduled_tokens.items():
            seq = self.seqs[seq_id]
            start = seq.num_computed_tokens
            end = start + num_new
            row_kinds.append((num_new, start >= seq.num_prompt_tokens))
            flat_start = len(input_ids)
            tokens = seq.token_ids
            if end > seq.num_tokens:  # drafted tokens to verify follow the verified ones
                tokens = tokens + sched.spec_token_ids[seq_id]
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            for feature in seq.mm_features:
                first, last = max(start, feature.offset), min(end, feature.end)
                if first < last:
                    image_spans.append(ImageSpan(feature, flat_start + first - start,
                                                 first - feature.offset, last - first))
            tree_parents = sched.spec_tree_parents.get(seq_id)
            if end > seq.num_tokens and tree_parents is not None:
                # Drafts keep their slots in node order but rotate by their depth.
                parents = tree_parents[: end - seq.num_tokens]
                rope_positions.extend(range(start, seq.num_tokens))
                rope_positions.extend(seq.num_tokens + d for d in tree_depths(parents))
                tree_masks[len(seq_lens)] = tree_attention_mask(
                    seq.num_tokens - start, parents, self.device
                )
            else:
                rope_positions.extend(range(start, end))
            if self.model_config.mrope_section:
                mrope_chunks.append(self._mrope_positions(seq, rope_positions[flat_start:]))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            tables.append(seq.block_ids)
            if end >= seq.num_tokens:
                num_rows = end - seq.num_tokens + 1
                sample_indices.extend(range(len(input_ids) - num_rows, len(input_ids)))
                sampling_seq_ids.append(seq_id)
                num_sample_rows.append(num_rows)
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                # Position p predicts prompt token p + 1; the last prompt position predicts
                # the first output token, which is not a prompt logprob.
                count = min(end, seq.num_prompt_tokens - 1) - start
                prompt_spans.append((seq_id, flat_start, count, start))

        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        rope_positions_t = positions_t
        if tree_masks:
            rope_positions_t = torch.tensor(rope_positions, dtype=torch.long, device=self.device)
        metadata = self._metadata(
            rope_positions_t, query_start_loc, seq_lens, tables, positions_t, tree_masks or None
        )
        self._copy_blocks(sched.block_copies)
        if self.lora is not None:
            self.lora.set_tokens([self.seqs[seq_id].lora_int_id for seq_id in sched.num_scheduled_tokens],
                                 list(sched.num_scheduled_tokens.values()))
        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if mrope_chunks:
            rope_positions_t = torch.cat(mrope_chunks, dim=1).to(self.device)
            if all(decode for _, decode in row_kinds):
                # Past every prompt the three coordinates are equal: plain RoPE, one row,
                # which is what the compiled decode graphs take.
                rope_positions_t = rope_positions_t[0].contiguous()
        inputs_embeds = self._merge_images(input_ids_t, image_spans) if image_spans else None
        streams = dict.fromkeys(self.aux_hidden_layers) if self.aux_hidden_layers else None
        joined_streams = None  # the streams side by side, where the compiled step returned them
        runs = row_runs(row_kinds) if self.batch_invariant else ()
        prompt_rows = any(not run.decode for run in runs)
        if (self.batch_invariant and self.compiled_decode is not None and inputs_embeds is None
                and streams is None and self.lora is None and rope_positions_t.dim() == 1):
            hidden = self._forward_decodes_compiled(input_ids_t, rope_positions_t, positions_t, metadata,
                                                    query_start_loc, seq_lens, tables, tree_masks, row_kinds)
        elif (inputs_embeds is None and self.compiled_decode is not None
                and self.compiled_decode.stream_layers == self.aux_hidden_layers
                and not prompt_rows and self.compiled_decode.applies(metadata)):
            if streams is None:
                hidden = self.compiled_decode.forward(input_ids_t, rope_positions_t, metadata)
            else:
                hidden, joined_streams = self.compiled_decode.forward_with_streams(input_ids_t, rope_positions_t,
                                                                                   metadata)
        else:
            with routed_rows(runs) if prompt_rows else contextlib.nullcontext():
                hidden = self.model(input_ids_t, rope_positions_t, self.kv_caches, metadata,
                                    inputs_embeds=inputs_embeds, residual_streams=streams)
        if not self.model.is_last_stage:  # a pipeline stage that hands its hidden states on
            return StepLogits(hidden.new_empty(0, 0), [], [], [])
        # The LM head runs only on the rows that sample or score.
        sample_hidden = hidden[sample_indices]
        sample_logits = self.model.compute_logits(sample_hidden)
        prompt_logits = [
            (seq_id, self.model.compute_logits(hidden[flat : flat + count]), pos + 1)
            for seq_id, flat, count, pos in prompt_spans
        ]
        step_hidden = (hidden if streams is None else joined_streams if joined_streams is not None
                       else torch.cat([streams[i] for i in self.aux_hidden_layers], dim=-1))
        return StepLogits(sample_logits, sampling_seq_ids, num_sample_rows, prompt_logits, sample_hidden, step_hidden)

    def _forward_decodes_compiled(
        self, input_ids: torch.Tensor, rope_positions: torch.Tensor, positions: torch.Tensor,
        metadata: AttentionMetadata, query_start_loc: list[int], seq_lens: list[int], tables: list[BlockTable],
        tree_masks: dict[int, torch.Tensor], row_kinds: list[tuple[int, bool]],
    ) -> torch.Tensor:
        """A batch-invariant step with compiled decode graphs: every decoding sequence's rows
        go through a graph whatever else the step holds, and only they. A graph's results
        differ from an eager forward's in the low bits, but not with the number of rows it
        runs or their contexts' lengths; so the decodes run in graph-sized groups and the
        prompts beside them in an eager forward of their own (the groups hold different
        sequences: none attends to another's rows, and each writes its own K/V)."""
        groups: list[tuple[list[int], bool]] = []  # (sequence indices, decode)
        prompts = [index for index, (_, decode) in enumerate(row_kinds) if not decode]
        if prompts:
            groups.append((prompts, False))
        group_rows = MAX_COMPILED_ROWS
        for index, (count, decode) in enumerate(row_kinds):
            if not decode:
                continue
            if group_rows + count > MAX_COMPILED_ROWS:
                groups.append(([], True))
                group_rows = 0
            groups[-1][0].append(index)
            group_rows += count
        if len(groups) == 1:
            return self._forward_group(input_ids, rope_positions, metadata, row_kinds, groups[0][1])
        hidden: torch.Tensor | None = None
        for indices, decode in groups:
            rows = torch.cat([torch.arange(query_start_loc[i], query_start_loc[i + 1]) for i in indices])
            rows = rows.to(self.device)
            group_metadata = self._metadata(
                rope_positions[rows], [0, *itertools.accumulate(row_kinds[i][0] for i in indices)],
                [seq_lens[i] for i in indices], [tables[i] for i in indices], positions[rows],
                {j: tree_masks[i] for j, i in enumerate(indices) if i in tree_masks} or None)
            group_hidden = self._forward_group(input_ids[rows], rope_positions[rows], group_metadata,
                                               [row_kinds[i] for i in indices], decode)
            if hidden is None:
                hidden = group_hidden.new_empty(input_ids.shape[0], group_hidden.shape[-1])
            hidden.index_copy_(0, rows, group_hidden)
        return hidden

    def _forward_group(self, input_ids: torch.Tensor, rope_positions: torch.Tensor, metadata: AttentionMetadata,
                       row_kinds: list[tuple[int, bool]], decode: bool) -> torch.Tensor:
        """Hidden states of sequences all decoding (a compiled graph where one applies) or all
        prompts (eager, each prompt's rows routed as a run of their own)."""
        if decode and self.compiled_decode.applies(metadata):
            return self.compiled_decode.forward(input_ids, rope_positions, metadata)
        with routed_rows(row_runs(row_kinds)) if not decode else contextlib.nullcontext():
            return self.model(input_ids, rope_positions, self.kv_caches, metadata)

    # -- images ----------------------------------------------------------------------------

    def _sequence_mrope(self, seq: RunnerSequence) -> tuple[torch.Tensor, int]:
        """The prompt's [3, prompt length] M-RoPE positions and the delta of later tokens."""
        if seq.mrope is None:
            merge = int((self.model_config.hf_config or {}).get("vision_config", {}).get("spatial_merge_size", 1))
            seq.mrope = mrope_positions(seq.num_prompt_tokens, seq.mm_features, merge)
        return seq.mrope

    def _rope_offsets(self, seqs: list[RunnerSequence]) -> list[int] | None:
        """Per sequence past its prompt, what its rotary position adds to its index: the
        M-RoPE delta (None for models without M-RoPE)."""
        if not self.model_config.mrope_section:
            return None
        return [self._sequence_mrope(seq)[1] for seq in seqs]

    def _mrope_positions(self, seq: RunnerSequence, positions: list[int]) -> torch.Tensor:
        """[3, len(positions)] M-RoPE positions of the sequence's tokens at these 1-D
        positions (ascending through the prompt; a token tree's drafts rotate by depth)."""
        prompt_positions, delta = self._sequence_mrope(seq)
        num_prompt = sum(1 for p in positions if p < seq.num_prompt_tokens)
        later = torch.tensor(positions[num_prompt:], dtype=torch.long) + delta
        return torch.cat([prompt_positions[:, positions[:num_prompt]], later.expand(3, -1)], dim=1)

    def _merge_images(self, input_ids: torch.Tensor, spans: list[ImageSpan]) -> torch.Tensor:
        """The step's input embeddings: token embeddings, with each image's placeholder
        rows replaced by its encoder output (encoded once per image, EncoderCache)."""
        embeddings = self.encoder_cache.get([span.feature for span in spans], self.model.encode_images,
                                            self._device_sync)
        inputs_embeds = self.model.model.embed_tokens(input_ids)
        for span in spans:
            rows = embeddings[span.feature.image_hash][span.first_row : span.first_row + span.num_rows]
            inputs_embeds[span.flat_start : span.flat_start + span.num_rows] = rows.to(inputs_embeds.device)
        return inputs_embeds
