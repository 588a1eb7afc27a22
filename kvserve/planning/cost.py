"""Dollars per token of self-hosted serving at a measured throughput, and where an API's
price per token breaks even with it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.planning.bench_results import BenchRun

# Illustrative on-demand prices of one GPU, US$ an hour, for trying the calculator: examples,
# not quotes (prices differ by provider, region and commitment); pass --gpu-price.
EXAMPLE_PRICES_DATE = "2026-12-03"
EXAMPLE_GPU_PRICES = {"h100-80gb": 2.50, "h200": 3.50, "a100-80gb": 1.50, "l40s": 1.00, "l4": 0.50}


@dataclass(frozen=True)
class Cost:
    run: BenchRun
    usd_per_hour: float  # all GPUs
    utilisation: float
    usd_per_million_tokens: float  # input and output tokens alike
    usd_per_million_output_tokens: float  # every dollar charged to the output
    tokens_per_usd: float
    tokens_per_s_per_usd_hour: float  # throughput at the utilisation, per dollar an hour
    # With an API's prices: this run's dollars split in the API's input:output ratio, what the
    # API would charge for the same tokens, and the utilisation where the two are equal.
    usd_per_million_input_at_api_ratio: float | None = None
    usd_per_million_output_at_api_ratio: float | None = None
    api_usd_per_million_tokens: float | None = None
    break_even_utilisation: float | None = None


def serving_cost(run: BenchRun, usd_per_gpu_hour: float, num_gpus: int = 1, utilisation: float = 1.0,
                 api_input_price: float | None = None, api_output_price: float | None = None) -> Cost:
    """The GPUs are paid every hour and busy `utilisation` of them, serving at the run's rate."""
    if usd_per_gpu_hour <= 0 or num_gpus < 1:
        raise ValueError("the GPU price must be > 0 and the GPU count >= 1")
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation}")
    hourly = usd_per_gpu_hour * num_gpus
    usd_per_busy_s = hourly / 3600 / utilisation
    input_rate, output_rate = run.input_tokens / run.duration_s, run.output_tokens / run.duration_s
    total_rate = input_rate + output_rate
    per_million = usd_per_busy_s / total_rate * 1e6
    cost = Cost(
        run, hourly, utilisation, per_million,
        usd_per_busy_s / output_rate * 1e6 if output_rate else float("inf"),
        1e6 / per_million, total_rate * utilisation / hourly,
    )
    if api_output_price is None and api_input_price is None:
        return cost
    api_in = api_input_price if api_input_price is not None else api_output_price
    api_out = api_output_price if api_output_price is not None else api_input_price
    api_usd_per_busy_s = (input_rate * api_in + output_rate * api_out) / 1e6
    if api_usd_per_busy_s <= 0:
        raise ValueError("the API prices must be > 0")
    scale = usd_per_busy_s / api_usd_per_busy_s
    return replace(
        cost, usd_per_million_input_at_api_ratio=api_in * scale,
        usd_per_million_output_at_api_ratio=api_out * scale,
        api_usd_per_million_tokens=api_usd_per_busy_s / total_rate * 1e6,
        break_even_utilisation=hourly / 3600 / api_usd_per_busy_s,
    )
