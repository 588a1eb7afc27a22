"""The token counts and busy time of a `kvserve bench serve` or `bench throughput` result,
whichever of their JSON files it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXPECTED = ("a `kvserve bench serve --output-json` result (total_input_tokens, total_output_tokens, "
            "duration_s), a `bench serve --sweep` result (sweep: a list of those), or a `kvserve bench "
            "throughput --output-json` result (results: prompt_tokens, output_tokens, elapsed_s)")


@dataclass(frozen=True)
class BenchRun:
    label: str
    input_tokens: int
    output_tokens: int
    duration_s: float
    # Mean requests in flight (Little's law over the per-request latencies), where recorded.
    mean_concurrency: float | None = None


def _serve_run(result: dict[str, Any]) -> BenchRun:
    latencies = [r["e2e_s"] for r in result.get("requests", []) if r.get("e2e_s") is not None]
    rate, limit = result.get("request_rate"), result.get("max_concurrency")
    label = f"{rate:g} req/s" if isinstance(rate, (int, float)) else "serve"
    return BenchRun(label + (f", at most {limit} in flight" if limit else ""), int(result["total_input_tokens"]),
                    int(result["total_output_tokens"]), float(result["duration_s"]),
                    sum(latencies) / result["duration_s"] if latencies else None)


def bench_runs(data: Any) -> list[BenchRun]:
    """Every measured run in a bench JSON; ValueError saying what was expected otherwise."""
    try:
        if isinstance(data, dict) and "sweep" in data:
            runs = [_serve_run(result) for result in data["sweep"]]
        elif isinstance(data, dict) and "total_output_tokens" in data:
            runs = [_serve_run(data)]
        elif isinstance(data, dict) and "results" in data:
            runs = [BenchRun(r["name"], int(r["prompt_tokens"]), int(r["output_tokens"]), float(r["elapsed_s"]))
                    for r in data["results"]]
        else:
            runs = []
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"expected {EXPECTED}; a field is missing or malformed ({error!r})") from None
    if not runs:
        keys = ", ".join(sorted(data)) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"expected {EXPECTED}; got {keys or 'an empty object'}")
    if any(run.duration_s <= 0 or run.output_tokens + run.input_tokens <= 0 for run in runs):
        raise ValueError("a run in the bench JSON has no tokens or no duration")
    return runs
