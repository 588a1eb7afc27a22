"""The side-by-side table and the per-step-kind profile, on small inputs counted by hand."""

from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.gpu_report import report_rows
from kvserve.benchmarks.step_profile import StepTimer


def test_report_rows_compare_with_transformers_and_floor(tmp_path):
    (tmp_path / "kvserve-w2-s.json").write_text(json.dumps({"results": [
        {"batch_size": 1, "tpot_ms_median": 5.0, "floor_ms": 4.0, "fraction_of_floor": 0.8}]}))
    (tmp_path / "kvserve-w1-s.json").write_text(json.dumps({
        "floor": {"floor_output_tok_s": 10000.0}, "results": [{"output_tok_s": 7500.0}]}))
    (tmp_path / "transformers-s.json").write_text(json.dumps({
        "w2_generate": [{"batch_size": 1, "tpot_ms": 30.0}],
        "w1_generate_batch": {"output_tok_s": 500.0, "num_requests": 64}}))
    rows = report_rows(str(tmp_path), "s")
    assert rows[0] == ["s", "W2 batch 1 TPOT ms", "5.00", "30.00", "6.0x", "4.00", "80%"]
    assert rows[1] == ["s", "W1 out tok/s", "7500", "500 (64 req)", "15.0x", "10000", "75%"]


def test_step_profile_counts_every_token_once():
    llm = LLM(load_format="dummy", model_shape="smollm2-135m", kv_cache_memory="64MiB", max_model_len=1024,
              max_num_batched_tokens=32)
    timer = StepTimer(llm)
    prompts = [list(range(1000, 1000 + n)) for n in (20, 45)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    steps = {kind: entry[0] for kind, entry in timer.totals.items()}
    tokens = {kind: entry[3] for kind, entry in timer.totals.items()}
    # Every prompt token and every output token but the last is fed once.
    assert sum(tokens.values()) == 20 + 45 + 2 * 5
    # 65 prompt tokens in 32-token chunks take 3 steps that carry prefill.
    assert steps["with prefill"] == 3
    assert timer.totals["decode only"][1] > 0
    assert tokens["decode only"] == pytest.approx(steps["decode only"] * 2, abs=2)
