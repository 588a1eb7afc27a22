"""Where W1's GPU time goes, by kernel: the whole offline workload (256 requests, 100-1024 in
and out, llama3-8b dummy weights) under torch.profiler, CUDA graphs off so that every kernel
is seen. Prints GPU time per kernel over the run.

    python benchmarks/gpu_w1_kernels.py [--quantization fp8] [--kv-cache-dtype fp8] [--num-prompts 256]
"""

from __future__ import annotations

import argparse

from gpu_step_kernels import kernel_times  # benchmarks/ is the script's directory

from kvserve.benchmarks.throughput import make_requests
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default=None, help="Weight method, or none for bf16.")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype (auto, fp8, ...).")
    parser.add_argument("--num-prompts", type=int, default=256, help="Requests (W1: 256).")
    parser.add_argument("--top", type=int, default=30, help="Kernels listed.")
    args = parser.parse_args()
    llm = LLM(load_format="dummy", model_shape="llama3-8b", quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True)
    requests = make_requests(args.num_prompts, (100, 1024), (100, 1024), llm.engine.model_config.vocab_size, 0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate(prompts[:2], params[:2])  # warm-up
    totals = kernel_times(llm, prompts, params)
    gpu_s = sum(us for _, us in totals.values()) / 1e6
    print(f"W1 {args.quantization or 'bf16'} kv {args.kv_cache_dtype} (eager): GPU kernels {gpu_s:.2f} s, "
          f"{sum(n for n, _ in totals.values())} kernels")
    for name, (calls, us) in sorted(totals.items(), key=lambda item: -item[1][1])[:args.top]:
        print(f"  {us / 1e6:7.3f} s {100 * us / 1e6 / gpu_s:5.1f}%  {calls:8d} calls  {us / calls:8.1f} us/call  {name}")


if __name__ == "__main__":
    main()
