"""quantization="fp8" on the CPU: e4m3 weights per output channel against an fp32 reference
of the rounding, the upcast matmul, and a whole engine run."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import EngineArgs
from kvserve.quantization import get_quantization_method
from kvserve.quantization.fp8 import Fp8Linear

from tests.quantization.test_checkpoints import assert_greedy_agrees, transformers_greedy


def e4m3_reference(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest (ties to even) on the e4m3 grid, in fp32 arithmetic: 3 mantissa
    bits, normal exponents down to -6 and subnormal steps of 2**-9 below, |v| <= 448."""
    exponent = torch.floor(torch.log2(values.abs().clamp(min=2.0**-6)))
    step = torch.exp2(exponent - 3)
    return (torch.round(values / step) * step).clamp(-448, 448)


def fp8_reference_weight(weight: torch.Tensor) -> torch.Tensor:
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    return e4m3_reference(weight / scale) * scale


@pytest.mark.parametrize("shape", [(37, 51), (96, 160), (200, 576)])
def test_fp8_round_trip_and_matmul(shape):
    torch.manual_seed(0)
    layer = nn.Linear(shape[1], shape[0])
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        layer.weight[0, :7] *= 20  # outliers, as real checkpoints have
    quantized = get_quantization_method("fp8").quantize_linear("layer", layer)
    assert isinstance(quantized, Fp8Linear) and quantized.qweight.dtype == torch.float8_e4m3fn
    reference = fp8_reference_weight(layer.weight.detach())
    torch.testing.assert_close(quantized.dequantize(), reference, rtol=0, atol=0)
    assert quantized.weight_bytes() == shape[0] * shape[1] + 4 * shape[0]  # e4m3 bytes, fp32 scales
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, shape[1])
        expected = x.double() @ reference.double().T + layer.bias.detach().double()
        torch.testing.assert_close(quantized(x).double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_fp8_grouped_scales_dequantize_per_group():
    """Block-wise checkpoints give one scale per group of input elements."""
    q = (torch.randn(8, 64) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(8, 2)
    layer = Fp8Linear(q, scale, None)
    expected = q.float() * scale.repeat_interleave(32, dim=1)
    torch.testing.assert_close(layer.dequantize(), expected, rtol=0, atol=0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scales \\[N, G\\] with G dividing K"):
        Fp8Linear(q, torch.rand(8, 3), None)


def test_fp8_engine_greedy_matches_the_dequantized_model(save_hf_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    reference = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    directory = save_hf_model(reference)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                module.weight.copy_(fp8_reference_weight(module.weight))
    prompts = [[1, 5, 9], [3, 7, 11, 13, 17], [2, 4, 8, 16, 32, 64, 127]]
    greedy, top5 = transformers_greedy(reference.eval(), prompts, 8)
    llm = LLM(model=directory, quantization="fp8", kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ours = [(list(o.outputs[0].token_ids), [set(step) for step in o.outputs[0].logprobs]) for o in outputs]
    assert assert_greedy_agrees(ours, greedy, top5) == len(prompts)


def test_fp8_cli_flag():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"
