"""`kvserve cost` on fixed bench JSON files against dollars computed by hand."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.cli import main

# 100 s busy: 200,000 input tokens (2,000/s) and 100,000 output tokens (1,000/s).
SERVE = {"model": "m", "request_rate": 4.0, "max_concurrency": None, "duration_s": 100.0,
         "total_input_tokens": 200_000, "total_output_tokens": 100_000,
         "requests": [{"e2e_s": 50.0}, {"e2e_s": 150.0}, {"e2e_s": None}]}


def _cost(tmp_path, capsys, data, *flags) -> dict:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    assert main(["cost", str(path), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_serve_result_by_hand(tmp_path, capsys):
    # $3.60 an hour is $0.001 a second; busy half the time, each busy second costs $0.002.
    out = _cost(tmp_path, capsys, SERVE, "--gpu-price", "3.6", "--utilisation", "0.5",
                "--api-input-price", "1", "--api-output-price", "4")
    cost = out["costs"][0]
    assert cost["usd_per_million_tokens"] == pytest.approx(0.002 / 3000 * 1e6)  # $0.6667
    assert cost["usd_per_million_output_tokens"] == pytest.approx(2.0)  # 0.002 / 1000 x 1e6
    assert cost["tokens_per_usd"] == pytest.approx(1.5e6)
    assert cost["tokens_per_s_per_usd_hour"] == pytest.approx(3000 * 0.5 / 3.6)
    # The API charges 2,000 x $1/M + 1,000 x $4/M = $0.006 per busy second, three times
    # more: split in its 1:4 ratio, $1/3 per million input and $4/3 per million output.
    assert cost["usd_per_million_input_at_api_ratio"] == pytest.approx(1 / 3)
    assert cost["usd_per_million_output_at_api_ratio"] == pytest.approx(4 / 3)
    assert cost["api_usd_per_million_tokens"] == pytest.approx(0.006 / 3000 * 1e6)  # $2
    assert cost["break_even_utilisation"] == pytest.approx(0.001 / 0.006)
    assert cost["run"]["mean_concurrency"] == pytest.approx(200 / 100)  # Little's law


def test_throughput_result_and_example_price(tmp_path, capsys):
    data = {"floor": {}, "results": [
        {"name": "kvserve continuous batching", "num_requests": 8, "elapsed_s": 10.0,
         "prompt_tokens": 8000, "output_tokens": 2000, "output_tok_s": 200.0, "total_tok_s": 1000.0},
    ]}
    out = _cost(tmp_path, capsys, data, "--gpu", "h100-80gb", "--num-gpus", "2")
    # Two example H100s at $2.50: $5 an hour, 1,000 tok/s: 3.6 M tokens an hour.
    assert out["costs"][0]["usd_per_million_tokens"] == pytest.approx(5 / 3.6)
    assert out["costs"][0]["usd_per_million_output_tokens"] == pytest.approx(5 / 0.72)
    assert "example" in out["price_note"]


def test_sweep_gives_a_row_per_rate(tmp_path, capsys):
    slow = SERVE | {"request_rate": 1.0, "duration_s": 300.0}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"sweep": [slow, SERVE], "plot": "p.png"}))
    plot = tmp_path / "cost.png"
    assert main(["cost", str(path), "--gpu-price", "3.6", "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    table = capsys.readouterr().out
    # 1,000 and 3,000 tok/s at $0.001 a second: $1/M and $0.3333/M.
    assert "1 req/s" in table and " 1.0000 " in table
    assert "4 req/s" in table and " 0.3333 " in table


@pytest.mark.parametrize("data", [{"floor": {}}, [1, 2], {"sweep": [{"duration_s": 1}]}])
def test_wrong_kind_of_json_says_what_was_expected(tmp_path, capsys, data):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(data))
    assert main(["cost", str(path), "--gpu-price", "2"]) == 2
    assert "expected a `kvserve bench serve --output-json` result" in capsys.readouterr().err


def test_a_price_is_required(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(SERVE))
    assert main(["cost", str(path)]) == 2
    assert "give the GPU price" in capsys.readouterr().err
