"""What crosses between the engine's front (LLMEngine: tokenizing, detokenizing, outputs)
and its core (scheduling and running the model): plain, picklable data, so the core can
run in a process of its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.multimodal.inputs import ImageFeature
from kvserve.lora.config import LoRAConfig
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.stats import SpecDecodeStats


@dataclass
class EngineCoreRequest:
    """A validated request: token ids, parameters, and its output budget."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length
    priority: int = 0
    arrival_time: float = 0.0
    # The prompt's images: placeholder spans (already expanded in prompt_token_ids) and
    # the preprocessed tensors the vision encoder reads.
    mm_features: list[ImageFeature] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # None: the base model


@dataclass
class SequenceDelta:
    """What one sample of a request got in a step."""

    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    num_drafts: int = 0  # speculative drafts verified this step, and accepted
    num_accepted: int = 0


@dataclass
class SchedulerStats:
    """The core's gauges and counters, as of the end of a step."""

    # Requests: running while any of their samples runs; sequences: each sample.
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_unfinished_requests: int = 0
    num_steps: int = 0  # steps that ran the model: the engine is making progress
    kv_cache_usage: float = 0.0
    # KV blocks: in use (held by a table), free but cached (a prefix hit revives them), and
    # of those in use, held by more than one table (prefix sharing, forks before their
    # copy-on-write); table references beyond one per block are block copies sharing saved.
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_shared: int = 0
    kv_shared_references: int = 0
    kv_slots_unused: int = 0  # token slots of used blocks holding nothing (internal fragmentation)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0
    decode_graphs_pending: int = 0  # CPU decode graphs still to compile
    num_steps_ahead: int = 0  # decode steps launched before the previous one was read
    num_images_encoded: int = 0  # images the vision encoder ran on (not those it had cached)
    encoder_seconds: float = 0.0  # and the time it took
    spec_decode: SpecDecodeStats | None = None  # None: the engine does not speculate
    # LoRA adapter name -> (running, waiting) requests on it (adapters with any).
    lora_requests: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutputs:
    deltas: list[SequenceDelta] = field(default_factory=list)
    # Requests scheduled for the first time: (when, prompt tokens found in the prefix cache).
    first_scheduled: dict[str, tuple[float, int]] = field(default_factory=dict)
    # Prompt logprobs entries computed this step, per request, in prompt order.
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    finished_requests: list[str] = field(default_factory=list)
    # Requests ended because their own sampling raised (id -> the error); the rest go on.
    failed_requests: dict[str, str] = field(default_factory=dict)
    stats: SchedulerStats | None = None


@dataclass
class EngineCoreInfo:
    """What the front needs to know of the core once it is built."""

    model_config: ModelConfig
    tokenizer: Any  # None without one (dummy weights, skip_tokenizer_init)
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    device: str
    kv_cache_dtype: torch.dtype
    attention_backend: str
    kv_bytes_per_block: int  # all layers (and all ranks) of one block of block_size tokens
    decode_weight_bytes: int  # what a batch-1 decode step reads of the weights (its bandwidth floor)
    expert_weight_bytes: int  # all experts of a mixture (model_bytes.decode_step_weight_bytes)
    lora_config: LoRAConfig | None = None  # None: the base model only
