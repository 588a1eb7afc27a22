"""One table from the JSON files of benchmarks/gpu_side_by_side.sh: kvserve beside
transformers on W2 and W1, each with its floor. A kvserve run with other flags is named
`SHAPE__VARIANT` (files kvserve-w1-SHAPE__VARIANT.json) and set beside the same transformers run.

    python -m kvserve.benchmarks.gpu_report OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys


def _load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def report_rows(out_dir: str, shape: str) -> list[list[str]]:
    rows = []
    w2 = _load(os.path.join(out_dir, f"kvserve-w2-{shape}.json"))
    w1 = _load(os.path.join(out_dir, f"kvserve-w1-{shape}.json"))
    base_shape = shape.split("__")[0]
    hf = _load(os.path.join(out_dir, f"transformers-{base_shape}.json")) or {}
    hf_w2 = {r["batch_size"]: r for r in hf.get("w2_generate", [])}
    for r in (w2 or {}).get("results", []):
        other = hf_w2.get(r["batch_size"])
        rows.append([
            shape, f"W2 batch {r['batch_size']} TPOT ms", f"{r['tpot_ms_median']:.2f}",
            f"{other['tpot_ms']:.2f}" if other else "-",
            f"{other['tpot_ms'] / r['tpot_ms_median']:.1f}x" if other else "-",
            f"{r['floor_ms']:.2f}", f"{r['fraction_of_floor']:.0%}",
        ])
    if w1:
        ours = w1["results"][0]
        other = hf.get("w1_generate_batch")
        floor = w1["floor"]["floor_output_tok_s"]
        rows.append([
            shape, "W1 out tok/s", f"{ours['output_tok_s']:.0f}",
            f"{other['output_tok_s']:.0f} ({other['num_requests']} req)" if other else "-",
            f"{ours['output_tok_s'] / other['output_tok_s']:.1f}x" if other else "-",
            f"{floor:.0f}", f"{ours['output_tok_s'] / floor:.0%}",
        ])
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = argv[0]
    shapes = sorted({
        name.split("-", 2)[2].removesuffix(".json")
        for name in os.listdir(out_dir) if name.startswith("kvserve-w")
    })
    header = ["shape", "metric", "kvserve", "transformers", "speedup", "floor", "of floor"]
    rows = [header] + [row for shape in shapes for row in report_rows(out_dir, shape)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
