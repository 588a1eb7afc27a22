"""Where a served decode step's time goes, read from a torch.profiler Chrome trace of decode
steps replayed as CUDA graphs (benchmarks/gpu_decode_timeline.py records one). Pure
functions over the trace's events:

* idle_report: per step, the device's busy and idle time between graph launches, the device
  work outside graphs, the idle gaps by what ran before and after them, and the host's
  runtime calls;
* chain_costs: what each kernel adds to a step inside its graph. Under programmatic dependent
  launch a kernel starts while the one before it runs and waits, so its own duration
  overstates it; its end minus the end of the device work before it does not;
* step_timeline: a few steps' host calls and device work outside graphs, in time order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cuda_runtime", "cpu_op", "python_function", "user_annotation"}


def _is_graph_launch(event: dict) -> bool:
    return event.get("cat") == "cuda_runtime" and event.get("name") == "cudaGraphLaunch"


def graph_launch_times(events: list[dict]) -> list[float]:
    """Host timestamps (us) of the graph launches, in order."""
    return sorted(e["ts"] for e in events if _is_graph_launch(e))


def graph_correlations(events: list[dict]) -> set[int]:
    """Correlation ids of the graph launches: a graph's device work carries its launch's."""
    return {e["args"]["correlation"] for e in events if _is_graph_launch(e) and "correlation" in e.get("args", {})}


def _device_work(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])


@dataclass
class IdleReport:
    """Totals over `steps` steps (divide by steps for per-step figures)."""

    steps: int
    span_us: float
    busy_us: float
    outside_graphs: dict[str, list[float]]  # name -> [calls, us]
    gaps: dict[tuple[str, str], list[float]]  # (work before, work after) -> [gaps, us]
    host_calls: dict[str, list[float]]  # runtime call -> [calls, us]


def idle_report(events: list[dict], skip: int) -> IdleReport | None:
    """The steps from graph launch `skip` to the last launch (None: too few launches)."""
    launches = graph_launch_times(events)
    if len(launches) < skip + 2:
        return None
    start, end = launches[skip], launches[-1]
    in_graph = graph_correlations(events)
    outside: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    busy, cursor, previous = 0.0, start, "(launch)"
    for e in _device_work(events):
        if not start <= e["ts"] < end:
            continue
        if e.get("args", {}).get("correlation") not in in_graph:
            outside[e["name"]][0] += 1
            outside[e["name"]][1] += e["dur"]
        begin, finish = e["ts"], e["ts"] + e["dur"]
        if begin > cursor:
            gaps[(previous, e["name"])][0] += 1
            gaps[(previous, e["name"])][1] += begin - cursor
        busy += max(0.0, finish - max(begin, cursor))
        cursor = max(cursor, finish)
        previous = e["name"]
    host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and start <= e["ts"] < end:
            host[e["name"]][0] += 1
            host[e["name"]][1] += e.get("dur", 0.0)
    return IdleReport(len(launches) - 1 - skip, end - start, busy, dict(outside), dict(gaps), dict(host))


def chain_costs(events: list[dict], skip: int, layers: int) -> tuple[int, dict[str, list[float]]]:
    """(steps, label -> each call's chain cost in us) over the graphs from the `skip`-th on.
    A kernel a step runs a multiple of `layers` times, more than once a layer, is labelled by
    its order within the layer (name#i: llama's qkv, o and down projections on one kernel)."""
    in_graph = graph_correlations(events)
    by_graph: dict[int, list[dict]] = defaultdict(list)
    for e in _device_work(events):
        correlation = e.get("args", {}).get("correlation")
        if correlation in in_graph:
            by_graph[correlation].append(e)
    steps = [sorted(work, key=lambda e: e["ts"] + e["dur"]) for _, work in sorted(by_graph.items())][skip:]
    costs: dict[str, list[float]] = defaultdict(list)
    for work in steps:
        calls: dict[str, int] = defaultdict(int)
        for e in work:
            calls[e["name"]] += 1
        seen: dict[str, int] = defaultdict(int)
        previous_end = work[0]["ts"]
        for e in work:
            per_layer = calls[e["name"]] // layers if calls[e["name"]] % layers == 0 else 0
            label = f"{e['name']}#{seen[e['name']] % per_layer}" if per_layer > 1 else e["name"]
            seen[e["name"]] += 1
            end = e["ts"] + e["dur"]
            costs[label].append(end - previous_end)
            previous_end = max(previous_end, end)
    return len(steps), dict(costs)


def step_timeline(events: list[dict], skip: int, count: int) -> list[tuple[float, float, str, str]]:
    """(us from graph launch `skip`, duration, "host" or "GPU", what) for `count` steps: host
    calls of at least 2 us and device work outside graphs, a graph as one row spanning its
    work (the 3 ms before the first launch included)."""
    launches = graph_launch_times(events)
    start, end = launches[skip], launches[skip + count]
    in_graph = graph_correlations(events)
    rows, graph_spans = [], defaultdict(list)
    for e in events:
        if "dur" not in e or not start - 3000 <= e["ts"] < end:
            continue
        if e.get("cat") in GPU_CATEGORIES:
            correlation = e.get("args", {}).get("correlation")
            if correlation in in_graph:
                graph_spans[correlation].append((e["ts"], e["ts"] + e["dur"]))
            else:
                rows.append((e["ts"] - start, e["dur"], "GPU", e["name"]))
        elif e.get("cat") in HOST_CATEGORIES and e["dur"] >= 2:
            rows.append((e["ts"] - start, e["dur"], "host", f"{e['cat']}: {e['name']}"))
    for spans in graph_spans.values():
        first, last = min(s for s, _ in spans), max(f for _, f in spans)
        rows.append((first - start, last - first, "GPU", f"graph ({len(spans)} activities)"))
    return sorted(rows)
