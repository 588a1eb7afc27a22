"""Cost per million tokens against requests in flight, one point per rate of a sweep."""

from __future__ import annotations

import logging

from kvserve.planning.cost import Cost


def plot_costs(costs: list[Cost], path: str) -> None:
    """x: mean requests in flight where the runs recorded them, else the run order."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    in_flight = [c.run.mean_concurrency for c in costs]
    measured = all(x is not None for x in in_flight)
    xs = in_flight if measured else list(range(1, len(costs) + 1))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(xs, [c.usd_per_million_tokens for c in costs], "o-", label="$ per million tokens")
    ax.plot(xs, [c.usd_per_million_output_tokens for c in costs], "s--", label="$ per million output tokens")
    for x, c in zip(xs, costs):
        ax.annotate(c.run.label, (x, c.usd_per_million_tokens), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("mean requests in flight" if measured else "run")
    ax.set_ylabel("US$")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"${costs[0].usd_per_hour:.2f}/h, utilisation {costs[0].utilisation:.0%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
