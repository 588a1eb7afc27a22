"""The W2 latency benchmark and the decode-step floor it reports."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.benchmarks.latency import run_latency
from kvserve.benchmarks.roofline import kv_bytes_per_token
from kvserve.model_executor.model_bytes import weight_bytes_per_step
from kvserve.model_executor.dummy import dummy_model_config
from kvserve.model_executor.models.llama import LlamaForCausalLM


@pytest.mark.parametrize(
    ("shape", "weights_gb", "kv_kib"),
    # BENCHMARKS.md, "Reading these numbers": llama3-8b's 16.06 GB of bf16 weights less the
    # 1.05 GB embedding, which a step only gathers, are 15.0 GB a step; qwen2.5-0.5b's tied
    # embedding is its LM head (0.99 GB in all).
    [("llama3-8b", 15.0, 128), ("qwen2.5-0.5b", 0.99, 12), ("smollm2-135m", 0.27, 22.5)],
)
def test_step_bytes_match_the_published_shapes(shape, weights_gb, kv_kib):
    config = dummy_model_config(shape, torch.bfloat16)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    assert weight_bytes_per_step(model, config) / 1e9 == pytest.approx(weights_gb, rel=0.02)
    assert kv_bytes_per_token(config) / 1024 == kv_kib


@pytest.mark.parametrize("shape", ["llama3-8b", "smollm2-135m"])
def test_a_quantized_lm_head_replaces_the_float_one_in_the_step_bytes(shape):
    """Untied (llama3-8b) and tied (SmolLM2): decode reads the int4 head, not the float one."""
    config = dummy_model_config(shape, torch.float32)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    float_step = weight_bytes_per_step(model, config)
    model.quantized_lm_head = torch.nn.Linear(config.hidden_size, 7, bias=False, device="meta")
    head = config.vocab_size * config.hidden_size * 4
    assert weight_bytes_per_step(model, config) == float_step - head + 7 * config.hidden_size * 4


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_latency_result_is_consistent(kv_cache_dtype):
    """The floor counts the weights once and the live KV in the cache's own dtype (one
    byte a value for fp8: 4x less than this fp32 model's)."""
    llm = LLM(load_format="dummy", model_shape="smollm2-135m", kv_cache_memory="64MiB", max_model_len=1024,
              kv_cache_dtype=kv_cache_dtype)
    bandwidth = 20e9
    result = run_latency(llm, batch_size=3, input_len=24, output_len=8, bandwidth=bandwidth)
    assert result.ttft_ms_median > 0 and result.tpot_ms_median > 0
    assert result.output_tok_s == pytest.approx(3 / (result.tpot_ms_median / 1e3))
    config = llm.engine.model_config
    weights = sum(p.numel() * p.element_size() for p in llm.engine.core.runner.model.parameters())
    weights -= 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * 4
    value_bytes = 1 if kv_cache_dtype == "fp8" else 4
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * value_bytes
    live_kv = 3 * (24 + 8 / 2) * kv_per_token
    assert result.floor_ms == pytest.approx((weights + live_kv) / bandwidth * 1e3)
    assert result.fraction_of_floor == pytest.approx(result.floor_ms / result.tpot_ms_median)
    # One prefill step for the three prompts, then one step a token: 7 decode steps, which
    # tile the span TPOT averages (so TPOT, their mean, lies between the shortest and the
    # longest, and the longest is under the whole span).
    assert result.decode_steps == 7
    assert 0 < result.step_ms_median <= result.step_ms_max
    assert result.tpot_ms_median <= result.step_ms_max * 1.05
    assert result.step_ms_max <= result.tpot_ms_median * 7 * 1.05


def test_decode_step_times_span_first_token_to_first_finish():
    """Steps that returned at 0, 1 (the batch's first tokens at 0.9), 3, 6 and 10 (the first
    finish at 9.5) and 12: the decode steps are 1 -> 3 -> 6 -> 10."""
    from kvserve.benchmarks.latency import decode_step_times

    assert decode_step_times([0.0, 1.0, 3.0, 6.0, 10.0, 12.0], 0.9, 9.5) == [2.0, 3.0, 4.0]
    assert decode_step_times([0.0, 1.0], 0.5, 0.5) == []


def test_linear_flops_count_every_weight_once():
    """2 FLOPs per weight of the linears and LM head: parameters counted on a meta model."""
    from kvserve.benchmarks.roofline import linear_flops_per_token

    config = dummy_model_config("llama3-8b", torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear_flops_per_token(config) == 2 * weights


@pytest.mark.parametrize("float8", [False, True])
def test_offline_floor_sums_steps_by_hand(float8):
    """Two requests, hand-counted: prefill pass, then decode steps while each runs. float8:
    an fp8 cache (a byte a value) and linears at twice the attention's FLOP rate."""
    from kvserve.benchmarks.roofline import (
        attention_flops_per_key,
        linear_flops_per_token,
        offline_floor_s,
    )

    config = dummy_model_config("smollm2-135m")
    kv = kv_bytes_per_token(config) // (4 if float8 else 1)  # fp32 model: 4 bytes a value
    linear, per_key = linear_flops_per_token(config), attention_flops_per_key(config)
    # Sized so that compute bounds the prefill pass and bytes (KV included) the decode steps.
    weight_bytes, bandwidth, peak = 1e6, 1e9, 1e12
    linear_peak = 2 * peak if float8 else peak
    # Prompts 3 and 5 tokens, outputs 2 and 4: decode steps 1..3 (request A only at step 1).
    prefill = linear * 8 / linear_peak + per_key * (6 + 15) / peak
    expected = max(weight_bytes / bandwidth, prefill)
    for live in ([4, 6], [7], [8]):
        expected += max((weight_bytes + kv * sum(live)) / bandwidth,
                        linear * len(live) / linear_peak + per_key * sum(live) / peak)
    extra = (torch.float8_e4m3fn, linear_peak) if float8 else ()
    got = offline_floor_s([3, 5], [2, 4], config, weight_bytes, bandwidth, peak, *extra)
    assert got == pytest.approx(expected)


def test_bench_latency_cli_writes_the_step_columns(tmp_path, capsys):
    """`kvserve bench latency` end to end: the table's step columns and the JSON's fields, 3
    decode steps for 4 output tokens (after its own warm-up run)."""
    import json

    from kvserve.entrypoints.cli import main

    out = tmp_path / "w2.json"
    assert main(["bench", "latency", "--load-format", "dummy", "--model-shape", "smollm2-135m",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--input-len", "8", "--output-len", "4",
                 "--batch-sizes", "1,2", "--output-json", str(out)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("batch"))
    assert header.split()[-4:] == ["step", "p50", "step", "max"]
    results = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 2]
    for r in results:
        assert r["decode_steps"] == 3
        assert 0 < r["step_ms_median"] <= r["step_ms_max"]


def test_bench_latency_cli_with_loras_runs_base_then_adapters(tmp_path, capsys, monkeypatch):
    """`--num-loras 2 --lora-rank 4`: every batch on the base model (no adapters), then on a
    LoRA engine with each batch's requests spread over the two random adapters, the tables of
    both and the TPOT ratios printed and written."""
    import json

    from kvserve.entrypoints.cli import main
    from kvserve.llm import LLM as LLMClass
    from tests.lora.tiny_model import save_tiny_llama

    save_tiny_llama(str(tmp_path / "model"))
    requested = []  # (LoRA enabled, the adapter ids of each request) of every generate call
    generate = LLMClass.generate

    def recording_generate(self, prompts, params=None, *args, lora_request=None, **kwargs):
        ids = [None if lora is None else lora.lora_int_id
               for lora in (lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts))]
        requested.append((self.engine.core.runner.lora is not None, ids))
        return generate(self, prompts, params, *args, lora_request=lora_request, **kwargs)

    monkeypatch.setattr(LLMClass, "generate", recording_generate)
    out = tmp_path / "w2.json"
    assert main(["bench", "latency", "--model", str(tmp_path / "model"), "--dtype", "float32",
                 "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--input-len", "8", "--output-len", "3",
                 "--batch-sizes", "1,2", "--num-loras", "2", "--lora-rank", "4", "--output-json", str(out)]) == 0
    # Warm-up (on the LoRA engine one request an adapter), batch 1, batch 2 on each engine.
    assert requested == [(False, [None]), (False, [None]), (False, [None, None]),
                         (True, [1, 2]), (True, [1]), (True, [1, 2])]
    printed = capsys.readouterr().out
    assert "base model:" in printed and "2 random LoRA adapter(s) of rank 4" in printed
    report = json.loads(out.read_text())
    assert report["num_loras"] == 2 and report["lora_rank"] == 4
    assert [r["batch_size"] for r in report["lora_results"]] == [1, 2]
    assert report["lora_vs_base_tpot"] == pytest.approx(
        [lora["tpot_ms_median"] / base["tpot_ms_median"] for lora, base in zip(report["lora_results"],
                                                                                report["results"])])


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_mixture_floors_count_the_experts_a_step_reads(shape):
    """A batch-1 step reads top_k of each layer's experts (Mixtral-8x7B: ~25.5 GB of its
    93 GB in bf16), a batch of B the expected share under uniform routing, and one token's
    linear FLOPs are 2 x the parameters it multiplies (the model's own parameters counted)."""
    from kvserve.benchmarks.roofline import linear_flops_per_token
    from kvserve.model_executor.layers.moe import SparseMoE
    from kvserve.model_executor.model_bytes import decode_step_weight_bytes, expert_weight_bytes

    config = dummy_model_config(shape, torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    experts = [p for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts for p in e.parameters()]
    all_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for p in experts)
    share = config.num_experts_per_tok / config.num_experts
    embedding = config.vocab_size * config.hidden_size
    batch_1 = weight_bytes_per_step(model, config)
    assert batch_1 == 2 * (all_params - embedding - expert_params) + round(2 * expert_params * share)
    assert expert_weight_bytes(model) == 2 * expert_params
    if shape == "mixtral-8x7b":
        assert batch_1 / 1e9 == pytest.approx(25.5, abs=0.1)
    # Batch 64 of Mixtral reads every expert but for a chance of (3/4)^64.
    batch_64 = decode_step_weight_bytes(batch_1, expert_weight_bytes(model), config, 64)
    assert batch_64 == pytest.approx(2 * (all_params - embedding) - 2 * expert_params * (1 - share) ** 64, rel=1e-9)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert linear_flops_per_token(config) == 2 * (all_params - embedding - norms - expert_params * (1 - share))
