"""Where a decode step's wall time goes on the GPU's timeline, CUDA graphs on (as served):
llama3-8b dummy weights, one request, profiled with torch.profiler (kernels, copies and
the host's runtime calls). Reports the device's busy and idle time per decode step, the
activities outside graphs, and the idle gaps grouped by what ran before and after them:
TPOT minus the graph's own time is in those gaps and those activities.

    python benchmarks/gpu_decode_timeline.py [--quantization int4|fp8] [--batch 1] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", default="llama3-8b", help="Dummy model shape.")
    parser.add_argument("--quantization", default=None, help="Weight-only method, or none for bf16.")
    parser.add_argument("--batch", type=int, default=1, help="Sequences decoded together.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=64, help="Tokens decoded per request.")
    parser.add_argument("--skip-steps", type=int, default=8,
                        help="Decode steps left out at the start (prefill, first graph replays).")
    parser.add_argument("--layers", type=int, default=32, help="Decoder layers of the model shape.")
    parser.add_argument("--dump-steps", type=int, default=0,
                        help="Also print this many steps' host calls and non-graph device work in order.")
    parser.add_argument("--trace", default=None, help="Also keep the Chrome trace at this path.")
    args = parser.parse_args()
    llm = LLM(load_format="dummy", model_shape=args.model_shape, quantization=args.quantization,
              max_num_seqs=max(args.batch, 1))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(args.input_len)]}
               for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: graphs captured, kernels compiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    report(events, args.output_len - 1, args.skip_steps)
    chain_costs(events, args.skip_steps, args.layers)
    if args.dump_steps:
        dump(events, args.skip_steps, args.dump_steps)


def graph_correlations(events: list[dict]) -> set:
    """Correlation ids of the graph launches: the device work of a graph carries its launch's."""
    return {e["args"]["correlation"] for e in events
            if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"
            and "correlation" in e.get("args", {})}


def dump(events: list[dict], skip: int, count: int) -> None:
    """Host calls (>= 2 us) and device work outside graphs, in time order, for `count` steps
    from graph launch `skip` on; a graph shows as its first and last kernel."""
    launches = sorted(e["ts"] for e in events
                      if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch")
    start, end = launches[skip], launches[skip + count]
    in_graph = graph_correlations(events)
    rows, graph_spans = [], defaultdict(list)
    for e in events:
        if "dur" not in e or not start - 3000 <= e["ts"] < end:
            continue
        cat = e.get("cat")
        if cat in GPU_CATEGORIES:
            corr = e.get("args", {}).get("correlation")
            if corr in in_graph:
                graph_spans[corr].append((e["ts"], e["ts"] + e["dur"]))
            else:
                rows.append((e["ts"], e["dur"], "GPU ", e["name"][:70]))
        elif cat in ("cuda_runtime", "cpu_op", "python_function", "user_annotation") and e["dur"] >= 2:
            rows.append((e["ts"], e["dur"], "host", f"{cat}: {e['name'][:70]}"))
    for spans in graph_spans.values():
        rows.append((min(s for s, _ in spans), max(f for _, f in spans) - min(s for s, _ in spans),
                     "GPU ", f"graph ({len(spans)} activities)"))
    print(f"timeline of {count} steps, us from graph launch {skip}:")
    for ts, dur, side, name in sorted(rows):
        print(f"  {ts - start:9.1f} {dur:8.1f}  {side}  {name}")


def chain_costs(events: list[dict], skip: int, layers: int) -> None:
    """What each kernel adds to a step inside its graph: its end minus the end of the device
    work before it (with PDL a kernel starts early and waits, so its own duration overstates
    it). Kernels a layer runs several times are told apart by their order in the layer
    (name#i)."""
    in_graph = graph_correlations(events)
    steps = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATEGORIES and e.get("args", {}).get("correlation") in in_graph:
            steps[e["args"]["correlation"]].append(e)
    ordered = [sorted(work, key=lambda e: e["ts"] + e["dur"]) for _, work in sorted(steps.items())][skip:]
    if not ordered:
        return
    costs = defaultdict(list)
    for work in ordered:
        per_step = defaultdict(int)
        for e in work:
            per_step[e["name"]] += 1
        seen = defaultdict(int)
        previous_end = work[0]["ts"]
        for e in work:
            name, end = e["name"][:60], e["ts"] + e["dur"]
            count = per_step[e["name"]]
            per_layer = count // layers if count % layers == 0 and count >= layers else 0
            label = f"{name}#{seen[e['name']] % per_layer}" if per_layer > 1 else name
            seen[e["name"]] += 1
            costs[label].append(end - previous_end)
            previous_end = max(previous_end, end)
    total = sum(sum(v) for v in costs.values()) / len(ordered)
    print(f"chain cost inside the graph, per step ({len(ordered)} steps): {total:.1f} us")
    for label, values in sorted(costs.items(), key=lambda kv: -sum(kv[1])):
        n = len(values) / len(ordered)
        print(f"  {sum(values) / len(ordered):8.1f} us/step  {n:5.1f} calls  {sum(values) / len(values):6.2f} us/call  {label}")


def report(events: list[dict], decode_steps: int, skip: int) -> None:
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e),
                 key=lambda e: e["ts"])
    launches = sorted(e["ts"] for e in events
                      if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch")
    print(f"{len(launches)} graph launches, {decode_steps} decode steps expected")
    if len(launches) < skip + 2:
        print("too few graph launches to measure (graphs off?)")
        return
    start, end = launches[skip], launches[-1]
    steps = len(launches) - 1 - skip
    window = [e for e in gpu if start <= e["ts"] < end]
    in_graph = graph_correlations(events)
    outside = defaultdict(lambda: [0, 0.0])
    busy, cursor = 0.0, start
    gaps = defaultdict(lambda: [0, 0.0])
    previous = "(launch)"
    for e in window:
        if e.get("args", {}).get("correlation") not in in_graph:
            entry = outside[e["name"][:80]]
            entry[0] += 1
            entry[1] += e["dur"]
        begin, finish = e["ts"], e["ts"] + e["dur"]
        if begin > cursor:
            key = (previous[:50], e["name"][:50])
            gaps[key][0] += 1
            gaps[key][1] += begin - cursor
        busy += max(0.0, finish - max(begin, cursor))
        cursor = max(cursor, finish)
        previous = e["name"]
    span = end - start
    print(f"{steps} steps from graph launch {skip} to the last: {span / steps:.1f} us a step, "
          f"device busy {busy / steps:.1f} us, idle {(span - busy) / steps:.1f} us")
    print("activities outside graphs, per step:")
    for name, (n, us) in sorted(outside.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {n / steps:5.2f} calls  {us / steps:7.2f} us  {name}")
    print("idle gaps by (activity before, activity after), per step:")
    for (before, after), (n, us) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {n / steps:5.2f} gaps  {us / steps:7.2f} us  {before}  ->  {after}")
    host = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and start <= e["ts"] < end:
            host[e["name"]][0] += 1
            host[e["name"]][1] += e.get("dur", 0.0)
    print("host runtime calls, per step:")
    for name, (n, us) in sorted(host.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {n / steps:5.2f} calls  {us / steps:7.2f} us  {name}")


if __name__ == "__main__":
    main()
