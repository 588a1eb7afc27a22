"""`kvserve bench prefix` (W4 shared-prefix): its prompts, the cache accounting of a run, and
the command end to end on dummy weights."""

from __future__ import annotations

import json

import pytest

from kvserve import LLM
from kvserve.benchmarks.shared_prefix import run_prefix, shared_prefix_prompts
from kvserve.entrypoints.cli import main


def test_prompts_share_exactly_the_prefix() -> None:
    prompts = shared_prefix_prompts(5, 40, 7, vocab_size=300, seed=1)
    assert [len(p) for p in prompts] == [47] * 5
    assert all(p[:40] == prompts[0][:40] for p in prompts)
    assert len({tuple(p[40:]) for p in prompts}) == 5
    assert min(min(p) for p in prompts) >= 10 and max(max(p) for p in prompts) < 300
    assert shared_prefix_prompts(5, 40, 7, vocab_size=300, seed=1) == prompts


def test_a_run_counts_the_prompt_tokens_the_cache_served() -> None:
    """A step budget of one prompt: the first request computes the 64-token prefix (4 blocks
    of 16), the three admitted after it find it cached; without the cache none does."""
    prompts = shared_prefix_prompts(4, 64, 8, vocab_size=49152, seed=0)
    counts = {}
    for caching in (True, False):
        llm = LLM(load_format="dummy", model_shape="smollm2-135m", kv_cache_memory="64MiB", max_model_len=1024,
                  max_num_batched_tokens=72, enable_prefix_caching=caching)
        result, outputs = run_prefix(llm, prompts, output_len=5)
        assert result.prefix_caching is caching and result.num_requests == 4
        assert [len(o) for o in outputs] == [5] * 4
        assert result.prompt_tokens == 4 * 72
        assert result.output_tok_s * result.wall_s == pytest.approx(20)
        assert result.ttft_ms_p50 <= result.ttft_ms_p90 <= result.ttft_ms_p99
        counts[caching] = result.cached_prompt_tokens
    assert counts == {True: 3 * 64, False: 0}


def test_the_command_runs_both_ways_and_writes_json(tmp_path, capsys) -> None:
    """A step budget of one 36-token prompt: the first request computes the prefix alone and
    the other two find it; the warm-up request must not have cached any of it."""
    path = tmp_path / "w4.json"
    assert main(["--log-level", "WARNING", "bench", "prefix", "--load-format", "dummy", "--model-shape",
                 "smollm2-135m", "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--max-num-batched-tokens", "36",
                 "--num-requests", "3", "--prefix-len", "32", "--question-len", "4", "--output-len", "3",
                 "--output-json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["workload"]["prefix_len"] == 32
    on, off = report["results"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["cached_prompt_tokens"] == 2 * 32 and off["cached_prompt_tokens"] == 0
    assert 0 <= report["identical_outputs"] <= 3
    out = capsys.readouterr().out
    assert "identical greedy outputs" in out and "dummy weights: greedy outputs are not expected to match" in out
