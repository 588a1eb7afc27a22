"""Quantized models on a GPU, engine level: the Triton weight-only kernels score a fixed
text as closely to an fp32 run of the quantized model as the dequantize path does. (The
kernels inside CUDA graphs are checked against references in test_triton_kernels.)"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.quantization import base

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_kernels_score_like_the_dense_path(save_hf_model, method, monkeypatch):
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    config = LlamaConfig(
        vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
    )
    # Saved in bf16, so that the fp32 and the bf16 runs quantize the same weight values.
    model_dir = save_hf_model(LlamaForCausalLM(config).to(torch.bfloat16))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (17, 40, 100, 250)]
    # Teacher forcing: every path scores the same tokens, so a near-tie flipping one greedy
    # choice cannot make the paths diverge. Steps of at most 64 tokens keep every prefill
    # step on the kernels (fp8 included, never _scaled_mm's fp8 activations).
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def run(dtype: str, kernels: bool) -> torch.Tensor:
        monkeypatch.setattr(base, "gpu_kernels_enabled", kernels)
        # The linears alone: without the int8 LM head copy that CUDA adds by default, which
        # only the kernel run would compute with.
        llm = LLM(model=model_dir, dtype=dtype, device="cuda", quantization=method,
                  quantization_config={"lm_head": False}, gpu_memory_utilization=0.3,
                  max_num_batched_tokens=base.GPU_KERNEL_MAX_ROWS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        logprobs = torch.tensor([
            entry[token] for o in outputs
            for token, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])
        ])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return logprobs

    reference = run("float32", kernels=False)  # fp32 activations: the dense path
    dense = run("bfloat16", kernels=False)
    kernels = run("bfloat16", kernels=True)
    dense_error = (dense - reference).abs().mean().item()
    kernel_error = (kernels - reference).abs().mean().item()
    print(f"{method}: mean |logprob - fp32| dense {dense_error:.4f}, kernels {kernel_error:.4f}")
    # Both carry bf16 activations; the kernels keep the dequantized weights unrounded, the
    # dense path rounds them to bf16. A wrong kernel is off by far more than either.
    assert kernel_error <= 2 * dense_error + 1e-3
