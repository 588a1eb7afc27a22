"""The CPU side-by-side benchmark: its table against hand-computed ratios, and
its `--quick` smoke mode end to end against a real `kvserve serve` (no llama.cpp)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess

import pytest

from kvserve.benchmarks import cpu_compare
from kvserve.benchmarks.cpu_compare import LoadPoint, combine_rounds, format_table, summarize
from kvserve.benchmarks.serve_datasets import random_prompts
from kvserve.benchmarks.llama_cpp_build import isa_cmake_flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _point(tok_s, ttft50, ttft99, itl50, itl99, rss=None, rate=math.inf):
    return {"output_tok_s": tok_s, "ttft_p50_ms": ttft50, "ttft_p99_ms": ttft99, "itl_p50_ms": itl50,
            "itl_p99_ms": itl99, "peak_rss_mib": rss, "request_rate": rate}


def test_table_rows_and_ratios_by_hand():
    results = {
        "llama.cpp": {"16-streams": _point(87.0, 9000.0, 12000.0, 111.0, 300.0, rss=200.0),
                      "poisson": _point(50.0, 400.0, 900.0, 60.0, 120.0, rate=0.5)},
        "kvserve": {"16-streams": _point(174.0, 4500.0, 6000.0, 80.0, 150.0, rss=800.0),
                    "poisson": _point(50.0, 200.0, 300.0, 70.0, 100.0, rate=0.5)},
    }
    lines = format_table(results, ["1-stream", "16-streams", "poisson"]).splitlines()
    rows = {tuple(line.split()[-4:]) for line in lines[2:]}
    # 174 / 87 = 2.00, 4500 / 9000 = 0.50, 800 / 200 = 4.00, 200 / 400 = 0.50
    assert ("tok/s", "87.0", "174.0", "2.00x") in rows
    assert ("ms", "9,000.0", "4,500.0", "0.50x") in rows
    assert ("MiB", "200", "800", "4.00x") in rows
    assert ("ms", "400.0", "200.0", "0.50x") in rows
    assert any(line.startswith("poisson 0.50/s") for line in lines)
    assert not any(line.startswith("1-stream") for line in lines)  # no data, no rows


def test_rounds_combine_as_medians_and_show_their_spread_by_hand():
    """Three rounds: each metric's median, counts summed, and the spread column with kvserve's
    range and its per-round ratios (round i against round i)."""
    llama = [_point(80.0, 300.0, 400.0, 12.0, 20.0) | {"completed": 8, "failed": 0} for _ in range(3)]
    ours = [_point(tok_s, 200.0, 300.0, itl, 15.0) | {"completed": 8, "failed": failed}
            for tok_s, itl, failed in ((60.0, 16.0, 0), (100.0, 10.0, 1), (90.0, 11.0, 0))]
    combined = combine_rounds(ours)
    assert (combined["output_tok_s"], combined["itl_p50_ms"]) == (90.0, 11.0)  # medians
    assert (combined["completed"], combined["failed"]) == (24, 1)  # summed
    assert combined["rounds"] == ours
    assert combine_rounds(ours[:1]) == ours[0]  # one round: as it is
    results = {"llama.cpp": {"1-stream": combine_rounds(llama)}, "kvserve": {"1-stream": combined}}
    lines = format_table(results, ["1-stream"]).splitlines()
    assert "3 rounds" in lines[0]
    # tok/s: median 90 against 80 (1.12x); rounds 60-100, ratios 60/80 = 0.75 to 100/80 = 1.25.
    assert lines[2].split()[-5:] == ["80.0", "90.0", "1.12x", "60.0-100.0", "(0.75-1.25x)"]
    itl = next(line for line in lines if "ITL p50" in line)
    assert itl.split()[-5:] == ["12.0", "11.0", "0.92x", "10.0-16.0", "(0.83-1.33x)"]


def test_summarize_reads_the_bench_serve_fields():
    data = {"output_throughput": 10.0, "request_throughput": 0.5, "completed": 4, "failed": 0,
            "total_output_tokens": 64, "output_tokens_expected": 64, "request_rate": math.inf,
            "duration_s": 6.4, "peak_rss_bytes": 3 * 2**20,
            "ttft_ms": {"p50": 1.0, "p99": 2.0}, "itl_ms": {"p50": 3.0, "p99": 4.0}}
    summary = summarize(data)
    assert summary["peak_rss_mib"] == 3.0
    assert (summary["ttft_p50_ms"], summary["ttft_p99_ms"], summary["itl_p50_ms"], summary["itl_p99_ms"]) == (1, 2, 3, 4)
    assert LoadPoint("x", 1, 1).input_len == 128 and LoadPoint("x", 1, 1).output_len == 128


def test_llama_cpp_build_names_the_cpu_isas_instead_of_native():
    """An AVX-512 CPU with AMX gets its vector ISAs by name and no -march=native (which would
    also enable AMX); an AVX2-only CPU gets AVX-512 off; no cpuinfo falls back to native."""
    amx_xeon = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
    flags = isa_cmake_flags(amx_xeon)
    assert "-DGGML_NATIVE=OFF" in flags and not any("AMX" in f for f in flags)
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"} <= set(flags)
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=OFF"} <= set(isa_cmake_flags({"avx", "avx2", "fma", "f16c"}))
    assert isa_cmake_flags(None) == ["-DGGML_NATIVE=ON"]


# Three Python processes (server, warm-up and measured client): ~50 s alone, ~100 s beside
# another test worker. The server and `bench serve` it drives have their own tests
# (tests/entrypoints, tests/benchmarks/test_bench_serve.py), and this file checks the
# table and summary by hand; run it with `pytest -m slow tests/benchmarks`.
@pytest.mark.slow
def test_quick_mode_runs_kvserve_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, "benchmarks", "cpu_vs_llamacpp.sh"), "--quick",
         "--output-dir", str(tmp_path), "--kvserve-args", "--kv-cache-memory 128MiB --max-model-len 2048 --no-compile-decode"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "cpu_quick.json") as f:
        summary = json.load(f)
    quick = summary["results"]["kvserve"]["quick"]
    # The reference is the request itself: 4 requests of 16 tokens each, none failed.
    assert quick["completed"] == 4 and quick["failed"] == 0
    assert quick["output_tokens"] == quick["output_tokens_expected"] == 4 * 16
    assert quick["output_tok_s"] > 0 and quick["ttft_p50_ms"] > 0 and quick["itl_p50_ms"] > 0
    assert quick["peak_rss_mib"] > 50  # at least the weights were resident
    assert "llama.cpp" not in summary["results"]
    assert "output tok/s" in result.stdout and "peak RSS MiB" in result.stdout
    with open(tmp_path / "cpu_quick_kvserve_quick.json") as f:
        records = json.load(f)["requests"]
    assert [r["output_tokens"] for r in records] == [16] * 4
    assert all(r["prompt_tokens"] == 32 for r in records)



def test_each_load_point_sends_prompts_no_other_point_sent(monkeypatch, tmp_path):
    """A server that keeps finished requests' KV (llama.cpp's slots, a prefix cache) must not
    meet a prompt again: each point's prompts, as `kvserve bench serve` draws them from the
    seed it is given, share no 16-token prefix with the warm-up's or another point's."""
    parser = argparse.ArgumentParser()
    cpu_compare.add_cli_args(parser)
    args = parser.parse_args(["--points", "1-stream,16-streams,poisson", "--output-dir", str(tmp_path)])
    sent: dict[str, tuple[LoadPoint, int]] = {}

    def record(run, point, seed, json_path, threads):
        sent[point.name] = (point, seed)
        open(json_path, "w").close()
        return {"output_throughput": 1.0, "request_throughput": 1.0, "completed": 1, "failed": 0,
                "total_output_tokens": 1, "output_tokens_expected": 1, "request_rate": point.request_rate,
                "duration_s": 1.0, "peak_rss_bytes": None, "ttft_ms": {"p50": 1.0, "p99": 1.0},
                "itl_ms": {"p50": 1.0, "p99": 1.0}}

    monkeypatch.setattr(cpu_compare, "run_bench", record)
    cpu_compare._run_points("kvserve", None, cpu_compare.load_points(args), args, 2, "t", None)
    assert set(sent) == {"warmup", "1-stream", "16-streams", "poisson"}
    assert sent["poisson"][0].request_rate == args.poisson_fraction  # 0.8 x the 16-stream 1.0 req/s
    prefixes = {}
    for name, (point, seed) in sent.items():
        prompts = random_prompts(point.num_prompts, (point.input_len,) * 2, (point.output_len,) * 2,
                                 (1000, 32000), seed)
        prefixes[name] = {tuple(p.prompt[:16]) for p in prompts}
    for a, b in itertools.combinations(prefixes, 2):
        assert not prefixes[a] & prefixes[b], (a, b)
