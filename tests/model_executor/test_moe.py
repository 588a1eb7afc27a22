"""Sparse mixtures of experts through the engine, against transformers (Mixtral here; the
Qwen MoE architectures' layers in test_llama_parity.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.model_executor.layers.moe import Router, SparseMoE
from kvserve.quantization.base import QuantizedLinear
from tests.model_executor.test_llama_parity import ARCHITECTURES, SMALL, VOCAB, reference_logits

NUM_EXPERTS = 4


def _mixtral(**overrides) -> MixtralForCausalLM:
    config = MixtralConfig(**{**SMALL, "num_local_experts": NUM_EXPERTS, "num_experts_per_tok": 2,
                              "sliding_window": None, **overrides})
    return MixtralForCausalLM(config).eval()


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_continuous_batch_decodes_as_transformers(save_hf_model, sliding_window) -> None:
    """Three prompts in one engine: every step's tokens split among the experts differently
    (prefill and decode rows together); each sequence's greedy tokens are transformers'."""
    hf_model = _mixtral(sliding_window=sliding_window)
    llm = LLM(model=save_hf_model(hf_model), kv_cache_memory="16MiB", block_size=4)
    prompts = _prompts((9, 14, 5))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                         min_new_tokens=12, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(output.outputs[0].token_ids) == expected


def test_int8_quantizes_every_expert_and_keeps_the_router(save_hf_model) -> None:
    hf_model = _mixtral()
    llm = LLM(model=save_hf_model(hf_model), kv_cache_memory="16MiB", quantization="int8")
    model = llm.engine.core.runner.model
    quantized = [name for name, m in model.model.layers.named_modules() if isinstance(m, QuantizedLinear)]
    layers = SMALL["num_hidden_layers"]
    assert len(quantized) == layers * (2 + 2 * NUM_EXPERTS)  # qkv, o; each expert's gate/up (w1, w3), down (w2)
    assert sum(isinstance(m, Router) for m in model.modules()) == layers
    assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, Router))

    prompt = _prompts((13,))[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    expected = torch.log_softmax(reference_logits(hf_model, prompt), dim=-1)
    errors = torch.tensor([out.prompt_logprobs[p][prompt[p]] - float(expected[p - 1, prompt[p]])
                           for p in range(1, len(prompt))]).abs()
    # Per-channel int8 moves these logprobs by about 0.01 (measured: 0.0006-0.014, and 0.067
    # where a token's second expert changes); swapped gate and up weights move them by 0.1-1.
    assert errors.median() < 0.02 and errors.max() < 0.1, errors


def test_compiled_decode_holds_packed_experts(save_hf_model) -> None:
    """Qwen2-MoE (a shared expert, unnormalised top-k, a dense first layer) with its
    experts packed: the compiled CPU decode steps run (the experts an opaque op inside the
    graph) and three sequences decode greedily as transformers does, batched and alone."""
    hf_model = ARCHITECTURES["qwen2-moe-shared-expert"]().eval()
    llm = LLM(model=save_hf_model(hf_model), compile_decode=True, kv_cache_memory="16MiB", block_size=4)
    runner = llm.engine.core.runner
    moe_layers = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert moe_layers and all(m.packed for m in moe_layers)
    compiled, calls = runner.compiled_decode, []
    forward = compiled.forward
    compiled.forward = lambda *args: calls.append(1) or forward(*args)
    prompts = _prompts((9, 14, 5))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    alone = llm.generate({"prompt_token_ids": prompts[2]}, params)
    for prompt, output in zip([*prompts, prompts[2]], [*outputs, *alone], strict=True):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                         min_new_tokens=8, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(output.outputs[0].token_ids) == expected
    assert len(calls) >= 2 * 7 - 2  # decode steps past the shortest context ran compiled


def test_quantized_experts_stay_unpacked_and_refuse_compile_decode(save_hf_model) -> None:
    path = save_hf_model(_mixtral())
    with pytest.raises(ValueError, match="unquantized experts"):
        LLM(model=path, quantization="int8", compile_decode=True, kv_cache_memory="16MiB")
    llm = LLM(model=path, quantization="int8", compile_decode=None, kv_cache_memory="16MiB")
    assert llm.engine.core.runner.compiled_decode is None
    assert not any(m.packed for m in llm.engine.core.runner.model.modules() if isinstance(m, SparseMoE))


def test_packing_keeps_one_copy_of_the_weights(save_hf_model) -> None:
    """The experts' linears become views of the stacked tensors: what a loader or a state
    dict sees is the packed memory itself."""
    llm = LLM(model=save_hf_model(_mixtral()), kv_cache_memory="16MiB")
    layer = next(m for m in llm.engine.core.runner.model.modules() if isinstance(m, SparseMoE))
    for index, expert in enumerate(layer.experts):
        assert expert.gate_up_proj.weight.data_ptr() == layer.w13.weight[index].data_ptr()
        assert expert.down_proj.weight.data_ptr() == layer.w2.weight[index].data_ptr()


def dequantized_expert(layer: SparseMoE):
    """run(expert, rows [n, H] fp32) -> that expert's MLP in fp32 on its dequantized weights."""
    def run(index: int, rows: torch.Tensor) -> torch.Tensor:
        expert = layer.experts[index]
        gate, up = (rows @ expert.gate_up_proj.dequantize(torch.float32).T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ expert.down_proj.dequantize(torch.float32).T
    return run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_gpu_quantized_experts_pack_and_match_each_expert_run_alone(save_hf_model, quantization) -> None:
    """On CUDA, weight-only quantized experts are stacked (their buffers views of the stacks)
    and run by the fused kernels: the layer's output equals each expert's weights, as its
    own quantized linears dequantize them, run on its tokens in fp32, one expert at a time.
    (Not the linears themselves: fp8 ones quantize their activations too on Hopper, which
    the weight-only fused experts do not.)"""
    from kvserve.model_executor.layers.moe import _grouped

    hf_model = _mixtral(hidden_size=256, intermediate_size=512)
    llm = LLM(model=save_hf_model(hf_model), quantization=quantization, device="cuda", dtype="bfloat16",
              kv_cache_memory="64MiB", enforce_eager=True)
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, SparseMoE)]
    assert layers and all(layer.packed for layer in layers)
    layer = layers[0]
    for index, expert in enumerate(layer.experts):
        assert expert.gate_up_proj.qweight.data_ptr() == layer.w13.weight[index].data_ptr()
        assert expert.down_proj.scale.data_ptr() == layer.w2.scale[index].data_ptr()
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    weights, chosen = torch.topk(torch.softmax(layer.gate(x).float(), dim=-1), layer.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        fused = layer(x).float()
        one_by_one = _grouped(x.float(), chosen, weights, len(layer.experts), dequantized_expert(layer))
    torch.testing.assert_close(fused, one_by_one, atol=2e-2 * one_by_one.abs().max().item(), rtol=0)
