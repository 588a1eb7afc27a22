"""`kvserve bench throughput --num-loras N --lora-rank R`: the base model and the same model
serving N random adapters, requests spread evenly over them, in one process on the same
requests: the cost of multi-LoRA as a ratio of throughputs."""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from kvserve.config import ModelConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.lora.random_adapters import write_random_adapter
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams], loras: list[LoRARequest | None] | None
         ) -> tuple[float, int]:
    """(seconds, output tokens) of one batch, after a short warm-up of the same shapes."""
    warm_up = min(len(prompts), 4)
    llm.generate(prompts[:warm_up], SamplingParams(temperature=0.0, max_tokens=4),
                 lora_request=loras[:warm_up] if loras else None)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True, lora_request=loras)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def lora_engine_args(engine_args: EngineArgs, num_loras: int, lora_rank: int) -> EngineArgs:
    """The engine arguments with LoRA on: at least `num_loras` slots of `lora_rank`."""
    return replace(engine_args, enable_lora=True, max_loras=max(engine_args.max_loras, num_loras),
                   max_cpu_loras=None, max_lora_rank=max(engine_args.max_lora_rank, lora_rank))


def random_adapters(directory: str, config: ModelConfig, num_loras: int, lora_rank: int) -> list[LoRARequest]:
    """`num_loras` random adapters written under `directory` (ids 1..num_loras)."""
    return [LoRARequest(f"random-{i}", i + 1, write_random_adapter(f"{directory}/{i}", config, lora_rank, i))
            for i in range(num_loras)]


def free_engine_memory() -> None:
    """After the last reference to an engine is dropped: its device memory back to the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_lora_comparison(engine_args: EngineArgs, make_requests: Callable[[int], list], num_loras: int,
                        lora_rank: int) -> dict:
    """Base first, its engine freed before the LoRA engine sizes its own KV cache.
    `make_requests(vocab_size)`: the workload (BenchRequests)."""
    llm = LLM(**vars(replace(engine_args, enable_lora=False)))
    config = llm.engine.model_config
    requests = make_requests(config.vocab_size)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    base_s, base_tokens = _run(llm, prompts, params, None)
    del llm
    free_engine_memory()
    with tempfile.TemporaryDirectory() as directory:
        adapters = random_adapters(directory, config, num_loras, lora_rank)
        llm = LLM(**vars(lora_engine_args(engine_args, num_loras, lora_rank)))
        loras = [adapters[i % num_loras] for i in range(len(requests))]
        lora_s, lora_tokens = _run(llm, prompts, params, loras)
    result = {"num_loras": num_loras, "lora_rank": lora_rank, "num_requests": len(requests),
              "base_output_tok_s": base_tokens / base_s, "lora_output_tok_s": lora_tokens / lora_s}
    result["lora_vs_base"] = result["lora_output_tok_s"] / result["base_output_tok_s"]
    print(f"\nbase model: {base_tokens} output tokens in {base_s:.1f} s = "
          f"{result['base_output_tok_s']:.1f} tok/s")
    print(f"{num_loras} LoRA adapters (rank {lora_rank}, requests spread evenly): {lora_tokens} output tokens in "
          f"{lora_s:.1f} s = {result['lora_output_tok_s']:.1f} tok/s")
    print(f"LoRA vs base: {result['lora_vs_base']:.2f}x")
    return result


def add_lora_comparison_args(group: argparse._ArgumentGroup, how: str) -> None:
    """--num-loras and --lora-rank of `kvserve bench throughput` and `bench latency`; `how`:
    how the requests are spread over the adapters."""
    group.add_argument("--num-loras", type=int, default=0,
                       help="Compare the base model with the same model serving this many random LoRA adapters "
                       f"(PEFT format, the model's real shapes, all seven projections), {how}: two engines, one "
                       "after the other, on the same requests (the LoRA one with at least this many --max-loras "
                       "slots). 0: the base model only.")
    group.add_argument("--lora-rank", type=int, default=16, help="Rank of the random adapters of --num-loras.")
