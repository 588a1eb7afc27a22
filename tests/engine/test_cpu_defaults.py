"""`--quantization auto` (serve's default) on CPU: what it picks for the embedded Q4_1 GGUF,
checked against the fp32 dequantized weights and logits as the reference."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvserve.engine.cpu_defaults import apply_plan, resolve_auto_quantization
from kvserve.engine.engine_args import CPU_MAX_NUM_BATCHED_TOKENS, EngineArgs
from kvserve.entrypoints.openai.cli_args import add_cli_args as add_serve_args
from kvserve.model_executor.loader import load_model
from kvserve.quantization.base import QuantizedLinear

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def auto_loaded(smollm2_path):
    loaded = load_model(smollm2_path, dtype=torch.float32)
    plan = resolve_auto_quantization(loaded, CPU)
    apply_plan(loaded, plan)
    return plan, loaded


def test_plan_for_the_q4_1_gguf_and_elsewhere(auto_loaded):
    plan, loaded = auto_loaded
    assert (plan.quantization, plan.quantization_config) == ("int4", {"group_size": 32})
    assert plan.keep_dense_weights and plan.quantize_lm_head and plan.reasons
    assert resolve_auto_quantization(loaded, torch.device("cuda")).quantization is None
    dummy = load_model(None, load_format="dummy", model_shape="smollm2-135m", dtype=torch.float32)
    assert resolve_auto_quantization(dummy, CPU).quantization is None


def test_int4_group32_keeps_the_gguf_grid_exactly(auto_loaded, smollm2_loaded):
    _, loaded = auto_loaded
    reference = dict(smollm2_loaded.model.named_modules())
    quantized = [(name, m) for name, m in loaded.model.named_modules()
                 if isinstance(m, QuantizedLinear) and name != "quantized_lm_head"]
    assert len(quantized) == 30 * 4  # qkv, o, gate_up, down per layer
    for name, module in quantized:
        # Reference: the GGUF's Q4_1 blocks dequantized to fp32 by the gguf package (a
        # separate load): the int4 grid must hold them exactly.
        assert torch.equal(module.dense_weight, reference[name].weight), name
        assert torch.allclose(module.dequantize(), reference[name].weight, rtol=0, atol=1e-6), name


def test_int8_lm_head_tracks_the_fp32_logits(auto_loaded, smollm2_loaded):
    _, loaded = auto_loaded
    torch.manual_seed(0)
    embed = smollm2_loaded.model.model.embed_tokens.weight
    # Realistic final hidden states: the model's own, for a few random tokens.
    hidden = smollm2_loaded.model.model.norm(embed[torch.randint(0, embed.shape[0], (8,))] * 30)
    reference = torch.nn.functional.linear(hidden, embed)
    logits = loaded.model.compute_logits(hidden)
    assert loaded.model.quantized_lm_head is not None
    scale = reference.abs().amax(dim=-1, keepdim=True)
    assert ((logits - reference).abs() / scale).max() < 0.03
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    # Prefill-sized inputs keep the fp32 head: exactly the reference.
    many = hidden.repeat(4, 1)
    assert torch.equal(loaded.model.compute_logits(many), torch.nn.functional.linear(many, embed))


def test_serve_defaults_are_auto_and_per_device_chunk():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert args.quantization == "auto" and args.max_num_batched_tokens is None
    assert args.resolved_max_num_batched_tokens(CPU) == CPU_MAX_NUM_BATCHED_TOKENS
    assert args.resolved_max_num_batched_tokens(torch.device("cuda")) == 2048
    explicit = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "none",
                                                           "--max-num-batched-tokens", "1024"]))
    assert explicit.quantization == "none" and explicit.resolved_max_num_batched_tokens(CPU) == 1024
