"""`kvserve cost`: dollars per million tokens from a bench JSON, a GPU price and a utilisation."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from kvserve.planning.bench_results import bench_runs
from kvserve.planning.cost import EXAMPLE_GPU_PRICES, EXAMPLE_PRICES_DATE, Cost, serving_cost


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bench_json", help="A `kvserve bench serve` or `bench throughput` --output-json file.")
    price = parser.add_argument_group("price (one of)")
    price.add_argument("--gpu-price", type=float, default=None, help="US$ per GPU-hour.")
    price.add_argument("--gpu", default=None, choices=list(EXAMPLE_GPU_PRICES),
                       help=f"Take the GPU-hour price from a built-in table of example prices "
                       f"({EXAMPLE_PRICES_DATE}; examples, not quotes).")
    parser.add_argument("--num-gpus", type=int, default=1, help="GPUs the benchmarked server ran on.")
    parser.add_argument("--utilisation", type=float, default=1.0,
                        help="Fraction of the paid hours the GPUs serve at the measured rate, in (0, 1].")
    parser.add_argument("--api-input-price", type=float, default=None,
                        help="An API's US$ per million input tokens, for the break-even (default: the output price).")
    parser.add_argument("--api-output-price", type=float, default=None,
                        help="An API's US$ per million output tokens (default: the input price).")
    parser.add_argument("--json", action="store_true", help="Print the costs as JSON.")
    parser.add_argument("--plot", default=None,
                        help="Write a PNG of the cost per million tokens against requests in flight "
                        "(a row per rate of a `bench serve --sweep` result) to this path.")


def _price(args: argparse.Namespace) -> tuple[float, str]:
    if (args.gpu_price is None) == (args.gpu is None):
        raise ValueError("give the GPU price: --gpu-price USD, or --gpu NAME for an example price "
                         f"({', '.join(f'{k} ${v:.2f}' for k, v in EXAMPLE_GPU_PRICES.items())}, "
                         f"examples of {EXAMPLE_PRICES_DATE})")
    if args.gpu_price is not None:
        return args.gpu_price, f"${args.gpu_price:.2f}/GPU-hour"
    price = EXAMPLE_GPU_PRICES[args.gpu]
    return price, f"${price:.2f}/GPU-hour ({args.gpu}, an example price of {EXAMPLE_PRICES_DATE}, not a quote)"


def format_costs(costs: list[Cost], price_note: str) -> str:
    first = costs[0]
    lines = [f"price: {price_note}, ${first.usd_per_hour:.2f}/h for all GPUs; utilisation {first.utilisation:.0%}"]
    header = f"{'run':34s} {'tok/s':>9s} {'in flight':>9s} {'$/M tok':>9s} {'$/M out':>9s} {'tok/s per $/h':>13s}"
    api = first.break_even_utilisation is not None
    if api:
        header += f" {'$/M in @api':>11s} {'$/M out @api':>12s} {'break-even':>10s}"
    lines.append(header)
    for c in costs:
        run = c.run
        rate = (run.input_tokens + run.output_tokens) / run.duration_s
        in_flight = "-" if run.mean_concurrency is None else f"{run.mean_concurrency:.1f}"
        row = (f"{run.label[:34]:34s} {rate:9.1f} {in_flight:>9s} {c.usd_per_million_tokens:9.4f} "
               f"{c.usd_per_million_output_tokens:9.4f} {c.tokens_per_s_per_usd_hour:13.1f}")
        if api:
            row += (f" {c.usd_per_million_input_at_api_ratio:11.4f} {c.usd_per_million_output_at_api_ratio:12.4f} "
                    f"{c.break_even_utilisation:10.1%}")
        lines.append(row)
    if api:
        lines.append(f"the API charges ${first.api_usd_per_million_tokens:.4f} per million of these tokens; "
                     "break-even: the utilisation at which self-hosting costs the same (above 100%: never)")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    price, note = _price(args)
    try:
        with open(args.bench_json, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{args.bench_json}: not JSON ({error})") from None
    try:
        runs = bench_runs(data)
    except ValueError as error:
        raise ValueError(f"{args.bench_json}: {error}") from None
    costs = [serving_cost(run, price, args.num_gpus, args.utilisation, args.api_input_price, args.api_output_price)
             for run in runs]
    if args.json:
        print(json.dumps({"gpu_price_usd_per_hour": price, "price_note": note,
                          "costs": [asdict(c) for c in costs]}, indent=2))
    else:
        print(format_costs(costs, note))
    if args.plot:
        from kvserve.planning.cost_plot import plot_costs

        plot_costs(costs, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
