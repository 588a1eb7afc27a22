"""Quantized models on a GPU: greedy output with the Triton weight-only kernels against the
same quantized weights run through the dequantize path, with CUDA graphs and eagerly."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.quantization import base

from tests.quantization.test_checkpoints import assert_greedy_agrees

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_kernels_greedy_agrees_with_the_dense_path(save_hf_model, method, monkeypatch):
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    # A small vocabulary: a random model's next-token distribution is nearly flat, and over
    # 1024 tokens bf16 rounding alone reorders more than its top 5 (seen on an H200).
    config = LlamaConfig(
        vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
    )
    model_dir = save_hf_model(LlamaForCausalLM(config))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (3, 17, 40, 100, 250)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    results = {}
    for kernels, eager in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(base, "gpu_kernels_enabled", kernels)
        # Steps of at most 64 tokens (chunked prefill): every step runs the Triton kernels
        # (fp8 included, never _scaled_mm's fp8 activations), or every step the dense path.
        llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", quantization=method,
                  gpu_memory_utilization=0.3, enforce_eager=eager,
                  max_num_batched_tokens=base.GPU_KERNEL_MAX_ROWS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[kernels, eager] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    dense_greedy = [tokens for tokens, _ in results[False, False]]
    dense_top5 = [[set(step) for step in logprobs] for _, logprobs in results[False, False]]
    for eager in (False, True):
        ours = results[True, eager]
        for (tokens, logprobs), (ref, ref_logprobs) in zip(ours, results[False, False]):
            if tokens != ref:  # where they part, for the log
                i = next(i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b)
                print(f"{method} eager={eager}: step {i}: kernels {tokens[i]} {logprobs[i]}, "
                      f"dense {ref[i]} {ref_logprobs[i]}")
        identical = assert_greedy_agrees([(t, [set(s) for s in lp]) for t, lp in ours], dense_greedy, dense_top5)
        print(f"{method} eager={eager}: {identical} of {len(prompts)} greedy sequences identical")
        # bf16 rounding differs between the paths: near-ties may flip (checked above).
        assert identical >= len(prompts) - 2
