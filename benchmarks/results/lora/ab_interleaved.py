"""Base model and multi-LoRA engines alive in one process, their runs alternated round by round
(a shared machine's load hits both alike): 16 streams of 32-token prompts and 48 greedy tokens,
spread over 4 random rank-16 adapters on all seven projections.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/lora/ab_interleaved.py --rounds 3 [--lora-first]

Prints each round's output tok/s and LoRA / base ratio, by wall time and by the process's CPU
time (less sensitive to other jobs taking the cores), and the medians; --profile prints a
torch.profiler table of one run of each instead."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from kvserve.benchmarks.throughput import make_requests
from kvserve.llm import LLM
from kvserve.lora.random_adapters import write_random_adapter
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--quantization", default="auto")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--streams", type=int, default=16)
parser.add_argument("--output-len", type=int, default=48)
parser.add_argument("--compile-decode", action="store_true")
parser.add_argument("--lora-first", action="store_true", help="Build the LoRA engine before the base one.")
parser.add_argument("--profile", action="store_true")
parser.add_argument("--json", default=None)
args = parser.parse_args()
engine_kwargs = dict(quantization=args.quantization, max_num_seqs=args.streams, kv_cache_memory="512MiB",
                     compile_decode=args.compile_decode)
lora_kwargs = dict(engine_kwargs, enable_lora=True, max_loras=4, max_lora_rank=16)
lora_llm = LLM(**lora_kwargs) if args.lora_first else None
base_llm = LLM(**engine_kwargs)
lora_llm = lora_llm or LLM(**lora_kwargs)
config = base_llm.engine.model_config
requests = make_requests(args.streams, (32, 32), (args.output_len, args.output_len), config.vocab_size, 0)
prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
directory = tempfile.mkdtemp()
adapters = [LoRARequest(f"random-{i}", i + 1, write_random_adapter(f"{directory}/{i}", config, 16, i))
            for i in range(4)]
loras = [adapters[i % 4] for i in range(len(requests))]


def run(llm: LLM, lora_requests: list | None) -> tuple[float, float]:
    """(output tok/s by wall time, CPU seconds) of one batch, after a short warm-up."""
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4),
                 lora_request=lora_requests[:4] if lora_requests else None, use_tqdm=False)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start), time.process_time() - cpu_start


if args.profile:
    from torch.profiler import ProfilerActivity, profile

    for name, llm, lora_requests in (("base", base_llm, None), ("lora", lora_llm, loras)):
        run(llm, lora_requests)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run(llm, lora_requests)
        print(f"===== {name}")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30))
    raise SystemExit
result = {"base_tok_s": [], "lora_tok_s": [], "ratio": [], "cpu_time_ratio": [], "load_1min": []}
for round_index in range(args.rounds):
    result["load_1min"].append(round(os.getloadavg()[0], 2))
    base_tok_s, base_cpu = run(base_llm, None)
    lora_tok_s, lora_cpu = run(lora_llm, loras)
    result["base_tok_s"].append(round(base_tok_s, 1))
    result["lora_tok_s"].append(round(lora_tok_s, 1))
    result["ratio"].append(round(lora_tok_s / base_tok_s, 3))
    result["cpu_time_ratio"].append(round(base_cpu / lora_cpu, 3))
    print(f"round {round_index}: base {base_tok_s:.1f} tok/s, LoRA {lora_tok_s:.1f} tok/s, ratio "
          f"{result['ratio'][-1]:.3f} (CPU time {result['cpu_time_ratio'][-1]:.3f}), load {result['load_1min'][-1]}",
          flush=True)
result["ratio_median"] = statistics.median(result["ratio"])
result["cpu_time_ratio_median"] = statistics.median(result["cpu_time_ratio"])
print(json.dumps(result))
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
