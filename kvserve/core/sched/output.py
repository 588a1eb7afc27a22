"""What the scheduler hands the model runner each step: plain, picklable data.

A runner keeps what it needs of every sequence between steps (its tokens and block table)
keyed by sequence id, so a step sends a sequence whole only the first time the runner sees
it (or after a preemption made the runner forget it) and afterwards only what changed. A
runner in another process, on another GPU or machine, receives exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.multimodal.inputs import ImageFeature
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams


@dataclass
class NewSequenceData:
    """A sequence the runner does not hold: everything it needs to run it."""

    seq_id: str
    token_ids: list[int]  # prompt, then the outputs so far (recomputed after a preemption)
    num_prompt_tokens: int
    num_computed_tokens: int  # prefix-cache hits count as computed
    block_ids: list[int]
    # Prompt logprobs are gathered from the request's first sample only.
    wants_prompt_logprobs: bool = False
    # How the runner samples it (None: the caller samples from the logits itself, as a
    # draft model's proposer does); `sample_index` seeds its generator (seed + index).
    params: SamplingParams | None = None
    sample_index: int = 0
    max_tokens: int = 0
    # The prompt's images (placeholder spans and encoder inputs).
    mm_features: list[ImageFeature] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


@dataclass
class CachedSequenceData:
    """A sequence the runner holds: what changed since it last ran."""

    seq_id: str
    new_token_ids: list[int]  # tokens appended since the runner last saw it
    num_computed_tokens: int
    # The block table keeps its first num_kept_blocks ids, then new_block_ids follow
    # (growth appends; copy-on-write replaces a block; dropped drafts trim the tail).
    num_kept_blocks: int
    new_block_ids: list[int]


@dataclass
class EncoderSlice:
    """Vision encoder work of one step on one job (a batch of images encoded together)."""

    job_id: int
    num_units: int  # row-passes to run (see config.EncoderSlicing)
    # The job's images, sent with its first slice only (the runner keeps them until it ends).
    images: list[ImageFeature] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    # Tokens each scheduled sequence runs this step; its order is the batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Speculative drafts verified after a sequence's last token (part of its scheduled
    # tokens), and their tree parents when the drafts form a tree (-1: the last token).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_tree_parents: dict[str, list[int]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination)
    # Sequences that finish their prompt this step and fork into n samples: parent id ->
    # (child id, sample index) of each other sample, sampled from the parent's logits.
    forks: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    # Overlapped scheduling: each sequence's input is the token its previous step sampled,
    # still on the device (the scheduler does not know it yet).
    inputs_in_flight: bool = False
    # Sequences the runner forgets before this step: finished or aborted since the last
    # step, and those preempted in this one (they come back as new sequences).
    finished_seq_ids: list[str] = field(default_factory=list)
    preempted_seq_ids: list[str] = field(default_factory=list)
    # Vision encoder slices the runner runs before the forward pass, and jobs it drops
    # (their partial state) because no sequence waits for their images any more.
    encoder_slices: list[EncoderSlice] = field(default_factory=list)
    encoder_cancelled: list[int] = field(default_factory=list)

    @property
    def scheduled_seq_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to run (what finished may still be news to it)."""
        return not self.num_scheduled_tokens and not self.encoder_slices and not self.encoder_cancelled


@dataclass
class SampledSequence:
    """What one sequence got from a step."""

    seq_id: str
    token_ids: list[int]  # one sampled token, or a verified run (accepted drafts + one)
    # One entry per token when the request asked for logprobs.
    logprobs: list[dict[int, float]] | None = None
    num_drafts: int = 0  # drafts verified this step
    num_accepted: int = 0
    # Accepted drafts whose KV the step wrote where the sequence continues (a token tree's
    # path off its leading nodes is not: those tokens are recomputed); None: all of them.
    num_accepted_in_place: int | None = None


@dataclass
class ModelRunnerOutput:
    """What the runner hands back for a step: plain data, like the step itself."""

    # In batch order; the samples a prompt forks into follow their parent.
    sampled: list[SampledSequence] = field(default_factory=list)
    # (sequence id, index of the first prompt token the entries score, entries).
    prompt_logprobs: list[tuple[str, int, list[dict[int, float]]]] = field(default_factory=list)
    # Speculative decoding: drafts proposed for each sequence's next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Drafts that form a token tree: the parent of each (-1: the newest token).
    draft_tree_parents: dict[str, list[int]] = field(default_factory=dict)
    # Sequences whose sampling raised (id -> the error): their requests fail, no other.
    failed: dict[str, str] = field(default_factory=dict)
    # Images whose embeddings the encoder cache dropped since the last output.
    encoder_evicted: list[str] = field(default_factory=list)
