"""Every user-facing engine option in one place, with its CLI flag and help text."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvserve.lora.config import LoRAConfig
from kvserve.quantization.cpu_plan import AUTO, NONE
from kvserve.quantization import QUANTIZATION_METHODS
from kvserve.attention.selector import BACKEND_NAMES
from kvserve.utils import parse_size

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# "auto": the model's dtype. "fp8" is e4m3 (more mantissa), as in vLLM.
KV_CACHE_DTYPES = {
    "auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


GPU_MAX_NUM_BATCHED_TOKENS = 2048
# A smaller step budget on CPU, so that prefill chunks of several prompts do not make every
# running stream and every waiting prompt wait for one multi-second step.
CPU_MAX_NUM_BATCHED_TOKENS = 512


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# Images a prompt may carry unless --limit-mm-per-prompt says otherwise.
DEFAULT_IMAGES_PER_PROMPT = 8
# Vision encoder row-passes one CPU step may run (--encoder-budget-per-step): less than a
# decode step of a decoder sized like the tower, so a step that encodes takes under twice a
# decode step (benchmarks/cpu_vision_itl.py: 1.7x at 128, 2.1x at 256).
CPU_ENCODER_BUDGET_PER_STEP = 128


def _mm_limits(text: str) -> dict[str, int]:
    """image=4 (vLLM's older form) or '{"image": 4}'."""
    if text.lstrip().startswith("{"):
        limits = _json_dict(text)
    else:
        limits = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"expected modality=N, got {item!r}")
            limits[key.strip()] = value.strip()
    try:
        limits = {key: int(value) for key, value in limits.items()}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"limits must be integers: {e}") from None
    unknown = set(limits) - {"image"}
    if unknown or any(value < 0 for value in limits.values()):
        raise argparse.ArgumentTypeError(f"only image=N with N >= 0 is supported, got {text!r}")
    return limits


@dataclass
class EngineArgs:
    model: str | None = None
    load_format: str = "auto"
    model_shape: str | None = None
    tokenizer: str | None = None  # None: the model's own
    skip_tokenizer_init: bool = False
    generation_config: str = "auto"  # auto: the model's sampling defaults; none: kvserve's
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    quantization: str | None = None
    quantization_config: dict[str, Any] | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = 2048  # None: per device (resolved_max_num_batched_tokens)
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    overlap_scheduling: bool | None = None  # None: on for GPUs (resolved_overlap_scheduling)
    compile_decode: bool | None = False  # None: on where supported (serve's default)
    # Greedy output independent of the batch (quantization/batch_invariance.py); None: on for
    # CPU with quantization=auto (serve's default).
    batch_invariant: bool | None = False
    # The engine core (scheduler and model) in a process of its own (core_proc.py).
    multiprocess_engine_core: bool = False
    tensor_parallel_size: int = 1  # worker processes, one per rank (executor/multiproc.py)
    pipeline_parallel_size: int = 1  # stages of consecutive layers, each tensor_parallel_size ranks
    enable_expert_parallel: bool = False  # mixtures of experts: whole experts per rank
    distributed_executor_backend: str = "mp"  # "mp": processes on this host; "ray": Ray actors
    speculative_config: dict[str, Any] | None = None
    # Images: most a prompt may carry ({"image": N}); where file:// URLs may point; whether
    # http(s) URLs are fetched.
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    # Vision encoder work one step may run, in row-passes (config.EncoderSlicing); 0: each
    # image encoded whole in one step; None: per device (resolved_encoder_budget_per_step).
    encoder_budget_per_step: int | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA limits (None without enable_lora)."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def resolved_device(self) -> torch.device:
        """The device to run on; one that is not here is an error before anything loads."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"device={self.device!r} is not a device name (cpu, cuda, cuda:N or auto)") from error
        if device.type == "cuda":
            if not torch.cuda.is_available():
                build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
                raise ValueError(f"device={self.device!r}, but CUDA is not available here (torch "
                                 f"{torch.__version__}, {build}); use --device cpu or auto")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device={self.device!r}, but there are {torch.cuda.device_count()} CUDA devices")
        elif device.type != "cpu":
            raise ValueError(f"device={self.device!r}: kvserve runs on cpu, cuda, cuda:N or auto")
        return device

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        # bf16 GEMMs with more than one row are ~100x slower than fp32 on CPUs without
        # AMX/AVX512-bf16, so CPU runs in fp32 unless told otherwise.
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        return _DTYPES[self.dtype]

    def resolved_kv_cache_dtype(self) -> torch.dtype | None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    def resolved_max_num_batched_tokens(self, device: torch.device) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_MAX_NUM_BATCHED_TOKENS if device.type == "cpu" else GPU_MAX_NUM_BATCHED_TOKENS

    def resolved_encoder_budget_per_step(self, device: torch.device) -> int:
        """On a GPU the tower runs whole by default: a batch of images encodes in milliseconds
        there, slices would replace its large batched kernels with many small launches, and
        the sliced tower's cost on a GPU is not measured yet."""
        if self.encoder_budget_per_step is not None:
            if self.encoder_budget_per_step < 0:
                raise ValueError(f"encoder_budget_per_step must be >= 0, got {self.encoder_budget_per_step}")
            return self.encoder_budget_per_step
        return CPU_ENCODER_BUDGET_PER_STEP if device.type == "cpu" else 0

    def resolved_batch_invariant(self, device: torch.device) -> bool:
        if self.batch_invariant is not None:
            return self.batch_invariant
        return device.type == "cpu" and self.quantization == AUTO

    def resolved_overlap_scheduling(self, device: torch.device) -> bool:
        # On a CPU the model runs in the host thread: there is nothing to overlap with.
        if self.overlap_scheduling is not None:
            return self.overlap_scheduling
        return device.type == "cuda"

    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("model and engine")
        group.add_argument(
            "--model", default=None,
            help="Hugging Face model directory or .gguf file "
            "(default: the embedded SmolLM2-135M-Instruct GGUF).",
        )
        group.add_argument(
            "--load-format", default="auto", choices=["auto", "dummy"],
            help="'dummy' builds random weights in the shape given by --model-shape.",
        )
        group.add_argument(
            "--model-shape", default=None,
            help="Shape for --load-format dummy: llama3-8b, qwen2.5-0.5b or smollm2-135m.",
        )
        group.add_argument(
            "--tokenizer", default=None,
            help="Tokenizer directory (or .gguf file) to use instead of the model's own, e.g. "
            "for a checkpoint directory without tokenizer files.",
        )
        group.add_argument(
            "--skip-tokenizer-init", action="store_true",
            help="Load no tokenizer: prompts must be token ids, outputs carry token ids and no "
            "text, and stop strings and chat requests are refused.",
        )
        group.add_argument(
            "--generation-config", default="auto", choices=["auto", "none"],
            help="auto: requests that leave temperature, top_p, top_k, min_p or "
            "repetition_penalty unset take the values the model's generation_config.json sets "
            "(as vLLM does; logged at start); none: SamplingParams' own defaults. `kvserve "
            "generate` and `chat` always use their flags' values.",
        )
        group.add_argument(
            "--dtype", default="auto", choices=["auto", *_DTYPES],
            help="Compute dtype (auto: bfloat16 on GPU, float32 on CPU).",
        )
        group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto.")
        group.add_argument("--seed", type=int, default=0, help="Seed for dummy weights.")
        group.add_argument(
            "--quantization", default=None, choices=[AUTO, NONE, *QUANTIZATION_METHODS],
            help="Quantization of the linear layers' weights, applied at load: int8 "
            "(symmetric, per output channel or group), int4 (asymmetric, group-wise), nf4 "
            "(bitsandbytes NormalFloat-4, per-block absmax), fp8 (float8_e4m3fn per output channel; "
            "on Hopper GPUs inputs of 2 or more rows are quantized to fp8 per token too, for "
            "kvserve's W8A8 kernel (up to 128 rows) or torch._scaled_mm, on Ada GPUs inputs of "
            "more than 64 rows, for torch._scaled_mm; smaller inputs, and CPUs, read the fp8 weight "
            "alone), gguf (run a GGUF file from its "
            "Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 blocks, repacked for the CPU kernels), auto (on "
            "CPU, a Q4_0/Q4_1 GGUF runs as int4 group 32, a Q8_0 one as int8 group 32 and other "
            "mixes of those types (Q4_K_M, ...) from their own blocks, all keeping the file's grid "
            "exactly, with an int8 LM head for decode; otherwise none; the choice is logged), or none. "
            "int8, int4 and fp8 also add an int8 copy of the LM head for decode "
            "(on GPU, and on CPU for an fp32 head; see --quantization-config). Default: "
            "none (auto for serve; GPTQ/AWQ/compressed-tensors checkpoints are detected from "
            "config.json).",
        )
        group.add_argument(
            "--quantization-config", default=None, type=_json_dict,
            help='JSON options of the quantization method, e.g. \'{"group_size": 32}\' for int4 or int8, '
            '\'{"lm_head": false}\' to keep the LM head in the run dtype alone (int8, int4 and fp8 add '
            'an int8 copy of it for decode on GPU, and on CPU for an fp32 head), \'{"lm_head": "int4"}\' '
            'for an int4 copy with int4.',
        )
        group.add_argument(
            "--max-model-len", type=int, default=None,
            help="Context length limit (prompt + output); default: the model's.",
        )
        group.add_argument(
            "--block-size", type=int, default=16, help="Tokens per KV-cache block.",
        )
        group.add_argument(
            "--kv-cache-memory", default=None,
            help="KV-cache size, e.g. 2GiB or 512MiB (default: 2GiB on CPU; on a GPU what is left "
                 "after the weights and the largest step at --gpu-memory-utilization).",
        )
        group.add_argument(
            "--gpu-memory-utilization", type=float, default=0.9,
            help="Fraction of GPU memory for weights, activations and the KV cache.",
        )
        group.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
            help="Reuse KV blocks of prompts that share a prefix.",
        )
        group.add_argument(
            "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
            help="KV-cache storage: auto (the model's dtype), bfloat16, float16, or float8 "
            "(fp8 = fp8_e4m3, or fp8_e5m2) with per-layer scales measured at startup, which "
            "holds twice the tokens of a bf16 cache.",
        )
        group.add_argument(
            "--max-num-seqs", type=int, default=256,
            help="Most sequences running in one step.",
        )
        group.add_argument(
            "--max-num-batched-tokens", type=int, default=2048,
            help="Token budget of one step (prefill chunks plus decodes); serve's default is "
            f"per device: {CPU_MAX_NUM_BATCHED_TOKENS} on CPU, {GPU_MAX_NUM_BATCHED_TOKENS} on GPU.",
        )
        group.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
            help="Split long prompts across steps so running decodes keep flowing. Without it a "
            "prompt runs whole, and one longer than --max-num-batched-tokens runs alone in a step of "
            "its own, over that budget.",
        )
        group.add_argument(
            "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
            help="Order of admission and preemption: arrival, or priority then arrival.",
        )
        group.add_argument(
            "--attention-backend", default="auto", choices=list(BACKEND_NAMES),
            help="Paged attention implementation (auto: Triton on GPU, except for models with "
            "sliding-window attention; torch elsewhere).",
        )
        group.add_argument(
            "--enforce-eager", action="store_true",
            help="Run every step eagerly. By default, on a GPU with the Triton attention backend, "
            "decode steps and speculative verify steps replay CUDA graphs: the graphs of short "
            "contexts are captured at startup (verify widths only at the batch sizes that "
            "speculate), those of longer contexts on first use. Mixture-of-experts models "
            "always run eagerly.",
        )
        group.add_argument(
            "--overlap-scheduling", action=argparse.BooleanOptionalAction, default=None,
            help="Launch each decode step before the host has read the previous step's "
            "tokens, so that bookkeeping and scheduling run while the GPU works (default: on "
            "for GPUs, off on CPU, where the model runs in the host thread; always off with "
            "speculative decoding). A sequence that ends at a stop token computes one extra "
            "token, which is dropped.",
        )
        group.add_argument(
            "--tensor-parallel-size", "-tp", type=int, default=1,
            help="Split every layer over this many worker processes (one per GPU; on a CPU "
            "each takes its share of the cores), Megatron-style: attention heads and MLP rows "
            "per rank, one all-reduce after each attention and MLP. Dense (unquantized) "
            "Llama-family models; no speculative decoding, CUDA graphs or CPU decode graphs yet.",
        )
        group.add_argument(
            "--pipeline-parallel-size", "-pp", type=int, default=1,
            help="Split the decoder layers into this many stages of consecutive layers (an even "
            "split, or KVSERVE_PP_LAYER_PARTITION's counts), each of --tensor-parallel-size "
            "ranks; the first stage holds the embedding, the last the norm and LM head. One batch "
            "is in flight at a time for now.",
        )
        group.add_argument(
            "--enable-expert-parallel", action="store_true",
            help="With --tensor-parallel-size N on a mixture of experts (Mixtral, Qwen2-MoE, "
            "Qwen3-MoE): each rank holds 1/N of the experts whole instead of 1/N of every "
            "expert's rows; each token's expert outputs are summed over the ranks.",
        )
        group.add_argument(
            "--distributed-executor-backend", default="mp", choices=["mp", "ray"],
            help="Where the ranks of --tensor-parallel-size run: mp, one process each on this "
            "host; ray, one Ray actor each on the Ray cluster this machine belongs to (`ray start "
            "--head`, then `ray start --address HEAD:6379` on the others), so a model can span "
            "machines.",
        )
        group.add_argument(
            "--multiprocess-engine-core", action=argparse.BooleanOptionalAction, default=False,
            help="Run the engine core (scheduler, model, sampling) in a process of its own and "
            "tokenizing, detokenizing and building outputs in the server's, so they overlap "
            "with the model's steps (default: off; see docs/architecture.md for when it pays).",
        )
        group.add_argument(
            "--compile-decode", action=argparse.BooleanOptionalAction, default=False,
            help="CPU: run decode steps of up to 16 sequences through one torch.compile'd "
            "graph of the model (inductor C++), compiled at startup: 2-3 graphs of ~10-15 s each "
            "on 2 cores (~1 min each at the first start, before the compile caches fill); a batch-1 "
            "SmolLM2 step takes ~30%% less time. "
            "`kvserve serve` turns it on by default where it applies (CPU, torch attention, "
            "a KV cache that is not float8) and compiles the graphs in a background thread, "
            "serving eager steps until each is ready; --no-compile-decode: eager only. "
            "With --batch-invariant (serve's CPU default) the graphs compile before serving, and "
            "every decode row runs through one: a step's prompt rows run eager beside them, and "
            "more than 16 decode rows in graph-sized groups (a graph's low bits differ from eager ones).",
        )
        group.add_argument(
            "--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
            help="CPU, quantized models: a request's greedy tokens do not depend on how many other "
            "requests share its steps. Decode rows always run the quantized kernels (int4/int8 "
            "linears, the int8 LM head copy), whatever the batch size, and prompt rows the dense "
            "copies, instead of switching every row to the dense copies past a few rows; prompts "
            "are cut into chunks at fixed boundaries (256 tokens with the CPU defaults), and prefix-cache "
            "hits reuse only whole chunks computed as prompt chunks. Costs decode throughput at many "
            "streams and prefix reuse, and compiles serve's default decode graphs before serving (see "
            "docs/batch-invariance.md). `kvserve serve` "
            "turns it on by default on CPU with --quantization auto; --no-batch-invariant: the "
            "per-batch-size plan.",
        )
        group.add_argument(
            "--speculative-config", default=None, type=_json_dict,
            help="Speculative decoding as JSON. Prompt lookup: '{\"method\": \"ngram\", "
            "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; "
            "draft model: '{\"method\": \"draft_model\", \"model\": \"<path or same>\", "
            "\"num_speculative_tokens\": 4, \"quantization\": \"int4\"}'; draft heads: "
            "'{\"method\": \"medusa\" | \"eagle\" | \"eagle3\", \"model\": \"<heads directory>\", "
            "\"num_speculative_tokens\": 4}' (optional \"speculative_token_tree\", e.g. "
            "\"[(0,), (0, 0), (1,)]\", verified as a token tree; EAGLE's branch off the top-1 chain "
            "only); jump-forward for structured "
            "outputs: '{\"method\": \"jump_forward\", \"num_speculative_tokens\": 8}' (the text a "
            "request's grammar forces is the draft; other requests do not draft). Optional "
            "\"disable_by_batch_size\" (default 8): no drafting while more sequences run. "
            "Output is unchanged (lossless verification).",
        )

        group.add_argument(
            "--limit-mm-per-prompt", default=None, type=_mm_limits,
            help="Most images a prompt may carry, as image=N or JSON '{\"image\": N}' "
            f"(default {DEFAULT_IMAGES_PER_PROMPT}); a request with more is refused with a 400.",
        )
        group.add_argument(
            "--encoder-budget-per-step", type=int, default=None,
            help="Vision encoder work one step may run, in patch rows times tower layers: an "
            "image's encoding is spread over steps so running streams keep "
            "decoding, and its placeholder tokens are prefilled once it is complete; 0 encodes each "
            f"image whole in one step. Default: {CPU_ENCODER_BUDGET_PER_STEP} on CPU, 0 on GPU.",
        )
        group.add_argument(
            "--allowed-local-media-path", default=None,
            help="A directory whose files chat requests may send as file:// image URLs "
            "(default: none; file:// URLs are refused). Paths resolving outside it are refused.",
        )
        group.add_argument(
            "--allow-remote-media", action=argparse.BooleanOptionalAction, default=False,
            help="Fetch http(s) image URLs of chat requests (default: off, only data: URLs and "
            "allowed file:// paths are read).",
        )

        group = parser.add_argument_group("LoRA adapters")
        group.add_argument(
            "--enable-lora", action="store_true",
            help="Serve LoRA adapters (PEFT format) on top of the base model: each request names "
            "one (or none) and one batch mixes them. `kvserve serve` takes them with "
            "--lora-modules; the offline API with LLM.generate(..., lora_request=...).",
        )
        group.add_argument(
            "--max-loras", type=int, default=4,
            help="Adapters resident on the device at once (its slots; every LoRA layer computes "
            "all slots for every token, so more slots cost time as well as memory). A request "
            "for another adapter waits until a slot's requests finish.",
        )
        group.add_argument(
            "--max-lora-rank", type=int, default=16,
            help="Rank of every slot; an adapter of a larger rank is refused.",
        )
        group.add_argument(
            "--max-cpu-loras", type=int, default=None,
            help="Adapters kept loaded in host memory, least recently used evicted first (an "
            "evicted adapter is read from disk again on its next request); default: --max-loras.",
        )

    @property
    def image_limit(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
