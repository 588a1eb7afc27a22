"""Engine configuration: plain dataclasses, validated where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ModelConfig:
    """Shape and numerics of one Llama-family decoder, whatever file it came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face `rope_scaling` dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    # Mistral: a token attends only to the last `sliding_window` positions (itself included).
    sliding_window: int | None = None
    # Mixtral, Qwen2-MoE, Qwen3-MoE: a sparse mixture of this many expert MLPs a layer (0: one
    # dense MLP), of which each token runs num_experts_per_tok, their router weights scaled to
    # sum to one where norm_topk_prob; Qwen2-MoE adds a shared expert every token runs.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    dense_mlp_layers: tuple[int, ...] = ()  # layers of a mixture model with a dense MLP
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    # The model creator's sampling values from generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty: those it sets), SamplingParams' names.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # Vision-language models: the checkpoint's whole config.json (the vision tower is built
    # from it), the token id an image's placeholder tokens carry, and Qwen2-VL's M-RoPE
    # split of the rotary frequencies into (temporal, height, width) sections.
    hf_config: dict[str, Any] | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, ...] | None = None

    @property
    def is_multimodal(self) -> bool:
        return self.image_token_id is not None


@dataclass
class CacheConfig:
    block_size: int = 16
    # Bytes given to the KV cache on CPU; None means "derive from the device" (see ModelRunner).
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Storage dtype of the paged KV cache; None: the model's dtype. float8 types store K/V
    # with a scale of 1.0 (no calibration) and are upcast when read.
    kv_cache_dtype: torch.dtype | None = None
    # Set by the model runner once the budget is known.
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class EncoderSlicing:
    """Vision encoder work spread over steps (core/sched/encoder_slicer.py). Work is counted
    in row-passes: one patch row through one pass of the tower (its patch embedding, or one
    of its blocks)."""

    budget_per_step: int  # row-passes one step may run (a job's first slice may take one group more)
    num_passes: int  # passes over an image's rows: the patch embedding, then each block
    rows_per_group: int  # rows a slice keeps together (the patch merger's merge group)
    # Rows of every image (LLaVA: its patches and class token); 0: each image's own, the
    # first dimension of its pixel_values (Qwen2-VL's patches).
    rows_per_image: int = 0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Chunked prefill: a long prompt is split across steps so that decodes keep flowing.
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    max_loras: int = 0  # LoRA adapters that may run at once (the device's slots); 0: no LoRA
    # Prompts cut only at fixed chunk boundaries, whatever else a step runs (canonical_chunks.py).
    batch_invariant: bool = False
    # None: each image is encoded whole in the step that first computes its placeholders.
    encoder_slicing: EncoderSlicing | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
