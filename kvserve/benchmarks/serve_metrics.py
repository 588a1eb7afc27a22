"""Serving-benchmark metrics, defined as `vllm bench serve` defines them so numbers compare.

TTFT: first streamed chunk with content minus send time. ITL: gaps between content chunks.
E2E: last content chunk minus send time. TPOT: (E2E - TTFT) / (output tokens - 1), for
requests with at least two output tokens. Goodput: requests meeting every SLO per second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0  # send time, relative to the benchmark start
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return asdict(self) | {"tpot_s": self.tpot_s}


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles (numpy's linear interpolation, as vLLM) in ms; None when empty."""
    if not values_s:
        return {"mean": None} | {f"p{p}": None for p in PERCENTILES}
    values_ms = np.asarray(values_s) * 1000.0
    return {"mean": float(values_ms.mean())} | {
        f"p{p}": float(np.percentile(values_ms, p)) for p in PERCENTILES
    }


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not record.success:
        return False
    if slo_ttft_ms is not None and record.ttft_s * 1000.0 > slo_ttft_ms:
        return False
    # A one-token request has no TPOT; it counts as 0, as in vLLM.
    return slo_tpot_ms is None or (record.tpot_s or 0.0) * 1000.0 <= slo_tpot_ms


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    max_errors: int = 5,
) -> dict:
    """Aggregate over the successful requests; failures are counted, their first distinct errors kept."""
    done = [r for r in records if r.success]
    errors = [r.error for r in records if not r.success]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done)
    return {
        "completed": len(done),
        "failed": len(errors),
        "errors": list(dict.fromkeys(errors))[:max_errors],  # first distinct messages
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "ttft_ms": summarize_ms([r.ttft_s for r in done]),
        "tpot_ms": summarize_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": summarize_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": summarize_ms([r.e2e_s for r in done]),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "good_requests": good if has_slo else None,
        "goodput": good / duration_s if has_slo else None,
    }
