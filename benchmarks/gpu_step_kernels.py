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
    return kernel_totals(prof)


def kernel_totals(prof: profile) -> dict[str, list[float]]:
    """A finished profile's device work: name -> [calls, total microseconds]."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:90]]
            entry[0] += 1
            entry[1] += event.device_time_total
    return totals


def print_kernel_diff(labels: tuple[str, str], left: dict[str, list[float]], right: dict[str, list[float]],
                      per: int, min_us: float = 2.0) -> None:
    """Two kernel_totals side by side in us per `per` (steps, replays), the kernels whose
    time grew most first (right minus left), with the right side's calls each."""
    print(f"{labels[0]:>9} {labels[1]:>9} {'diff':>8} {'calls':>6}  kernel")
    empty = [0, 0.0]
    for name in sorted(set(left) | set(right), key=lambda n: -(right.get(n, empty)[1] - left.get(n, empty)[1])):
        a, b = left.get(name, empty)[1] / per, right.get(name, empty)[1] / per
        if max(a, b) >= min_us:
            print(f"{a:9.1f} {b:9.1f} {b - a:8.1f} {right.get(name, empty)[0] / per:6.1f}  {name}")
    print(f"{sum(v[1] for v in left.values()) / per:9.1f} {sum(v[1] for v in right.values()) / per:9.1f}"
          "                 all kernels")

if __name__ == "__main__":
    main()
