"""Where one eager decode step's GPU time goes, by kernel: llama3-8b dummy weights at
batch 1 (or --batch), profiled with torch.profiler over a few decode steps (CUDA graphs off, so each
kernel is seen; a prefill-only run is subtracted; graph replay adds ~1 us of launch gap a kernel on top of these times).

    python benchmarks/gpu_step_kernels.py [--quantization int4|fp8] [--kv-cache-dtype fp8] [--batch 1] [--steps 8]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", default="llama3-8b", help="Dummy model shape.")
    parser.add_argument("--quantization", default=None, help="Weight-only method, or none for bf16.")
    parser.add_argument("--steps", type=int, default=8, help="Decode steps profiled.")
    parser.add_argument("--batch", type=int, default=1, help="Sequences decoded together.")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype (auto, fp8, ...).")
    args = parser.parse_args()
    llm = LLM(load_format="dummy", model_shape=args.model_shape, quantization=args.quantization,
              enforce_eager=True, max_num_seqs=args.batch, kv_cache_dtype=args.kv_cache_dtype)
    prompt = [{"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params)  # warm-up: compiles every kernel
    # The decode steps alone: a run of steps + 1 tokens minus a prefill-only run.
    decode = kernel_times(llm, prompt, params)
    for name, (calls, us) in kernel_times(llm, prompt, SamplingParams(max_tokens=1, ignore_eos=True)).items():
        decode[name][0] -= calls
        decode[name][1] -= us
    steps = args.steps
    total_us = sum(us for _, us in decode.values())
    print(f"{args.quantization or 'bf16'} (kv {args.kv_cache_dtype}, batch {args.batch}): "
          f"{total_us / steps / 1000:.3f} ms of kernels per decode step, "
          f"{sum(n for n, _ in decode.values()) / steps:.0f} kernels per step")
    for name, (calls, us) in sorted(decode.items(), key=lambda item: -item[1][1])[:25]:
        if calls > 0:
            print(f"  {us / steps:8.1f} us/step  {calls / steps:6.1f} calls/step  {us / calls:7.2f} us/call  {name}")


def kernel_times(llm: LLM, prompt: list[dict], params: SamplingParams | list[SamplingParams]) -> dict[str, list[float]]:
    """Kernel name -> [calls, total device microseconds] over one generate call (also used by
    gpu_w1_kernels.py)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:90]]
            entry[0] += 1
            entry[1] += event.device_time_total
    return totals

if __name__ == "__main__":
    main()
