"""examples/grafana/kvserve.json: every metric its queries read, and every label they select,
group or name series by, is one that a running server's /metrics really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvserve.json"
SELECTOR = re.compile(r"(kvserve:[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def _exported(server) -> dict[str, set[str]]:
    """Sample name -> its label names, as the server's /metrics has them."""
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def _queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, expression, legend format) of every query of the dashboard."""
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"], target.get("legendFormat", "")))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append((f"${variable['name']}", variable["query"]["query"], ""))
    return queries


def test_every_query_reads_exported_metrics_and_labels(server):
    # A finished request, so the counters labelled per finish reason have a sample.
    server.client().completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    exported = _exported(server)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 20
    used = set()
    for where, expression, legend in queries:
        metrics = SELECTOR.findall(expression)
        assert metrics, f"{where}: {expression} reads no kvserve metric"
        labels_here: set[str] = set()
        for name, selector in metrics:
            assert name in exported, f"{where}: {name} is not on /metrics"
            selected = set(MATCHER.findall(selector))
            assert selected <= exported[name], f"{where}: {name} has no label {selected - exported[name]}"
            labels_here |= exported[name]
            used.add(name)
        for group in GROUPING.findall(expression):
            grouped = {label.strip() for label in group.split(",") if label.strip()}
            assert grouped <= labels_here, f"{where}: grouped by {grouped - labels_here}, which no metric has"
        assert set(LEGEND_LABEL.findall(legend)) <= labels_here, f"{where}: legend {legend}"
    # The KV monitor's gauges and the latency histograms are all on it.
    for name in ("kvserve:kv_cache_blocks", "kvserve:kv_cache_internal_fragmentation",
                 "kvserve:kv_cache_sharing_saved_bytes", "kvserve:prefix_cache_hits_total",
                 "kvserve:num_preemptions_total", "kvserve:time_to_first_token_seconds_bucket",
                 "kvserve:inter_token_latency_seconds_bucket"):
        assert name in used, name


def test_panels_fit_the_grid_and_are_uniquely_identified():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            ref_ids = [target["refId"] for target in panel["targets"]]
            assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]
