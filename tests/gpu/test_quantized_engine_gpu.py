"""Quantized models on a GPU, engine level: the Triton weight-only kernels score a fixed
text as closely to an fp32 run of the quantized model as the dequantize path does. (The
kernels inside CUDA graphs are checked against references in tests/ops/quant/test_weight_only.py.)"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.ops.quant import fp8_w8a8
from kvserve.quantization import base
from kvserve.quantization.fp8 import Fp8Linear

pytestmark = pytest.mark.gpu


def _prompt_logprobs(model_dir: str, prompts: list[list[int]], **llm_args) -> torch.Tensor:
    """Each prompt's logprobs of its own tokens, teacher-forced: every run scores the same
    tokens, so a near-tie flipping one greedy choice cannot make two runs diverge. The
    linears alone: without the int8 LM head copy CUDA adds by default."""
    llm = LLM(model=model_dir, device="cuda", quantization_config={"lm_head": False}, gpu_memory_utilization=0.3,
              **llm_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return torch.tensor([entry[token] for o in outputs
                         for token, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])])


def _random_llama(save_hf_model, seed: int, prompt_lengths: tuple[int, ...], **config) -> tuple[str, list[list[int]]]:
    """A random Llama of 256 tokens saved in bf16 (so that fp32 and bf16 runs quantize the
    same weight values), and random prompts of the given lengths."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, max_position_embeddings=1024, **config))
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in prompt_lengths]
    return save_hf_model(model.to(torch.bfloat16)), prompts


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_kernels_score_like_the_dense_path(save_hf_model, method, monkeypatch):
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9")
    model_dir, prompts = _random_llama(save_hf_model, 0, (17, 40, 100, 250), hidden_size=512, intermediate_size=1536,
                                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    # Steps of at most 64 tokens (fp8: 16, as on Ada, without fp8_w8a8) keep every prefill
    # step on the weight-only kernels (never fp8 activations: fp8_w8a8, _scaled_mm).
    step_tokens = 16 if method == "fp8" else base.GPU_KERNEL_MAX_ROWS
    monkeypatch.setattr(fp8_w8a8, "W8A8_MIN_ROWS", step_tokens + 1)

    def run(dtype: str, kernels: bool) -> torch.Tensor:
        monkeypatch.setenv("KVSERVE_QUANTIZED_GPU_KERNELS", "1" if kernels else "0")
        return _prompt_logprobs(model_dir, prompts, dtype=dtype, quantization=method,
                                max_num_batched_tokens=step_tokens)

    reference = run("float32", kernels=False)  # fp32 activations: the dense path
    dense = run("bfloat16", kernels=False)
    kernels = run("bfloat16", kernels=True)
    dense_error = (dense - reference).abs().mean().item()
    kernel_error = (kernels - reference).abs().mean().item()
    print(f"{method}: mean |logprob - fp32| dense {dense_error:.4f}, kernels {kernel_error:.4f}")
    # Both carry bf16 activations; the kernels keep the dequantized weights unrounded, the
    # dense path rounds them to bf16. A wrong kernel is off by far more than either.
    assert kernel_error <= 2 * dense_error + 1e-3


@pytest.mark.parametrize("step_tokens", (100, 12))
def test_fp8_w8a8_kernel_scores_like_scaled_mm(save_hf_model, monkeypatch, step_tokens):
    """fp8 at 2-128 rows: kvserve's W8A8 kernel (fp8_w8a8) against `_scaled_mm` on the same
    per-token fp8 activations, both scored against an fp32 run of the quantized weights.
    Prefill chunks of 100 tokens: o_proj and down (4096 wide) take the kernel, qkv and gate/up
    cuBLAS (w8a8_config); chunks of 12 (and a last one of 4): all take its 16-row tile. With
    the kernel routed off, all take cuBLAS."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("fp8_w8a8 runs on Hopper")
    model_dir, prompts = _random_llama(save_hf_model, 2, (100, 300), hidden_size=4096, intermediate_size=4096,
                                       num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8)
    calls = []
    kernel = fp8_w8a8.fp8_w8a8_matmul

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fp8_w8a8, "fp8_w8a8_matmul", counted)

    def run(dtype: str, w8a8: bool) -> torch.Tensor:
        if not w8a8:  # every step on _scaled_mm, 12 rows too (not the weight-only kernel)
            monkeypatch.setattr(fp8_w8a8, "w8a8_config", lambda *args: None)
            monkeypatch.setattr(Fp8Linear, "gpu_kernel_max_rows", 0)
        return _prompt_logprobs(model_dir, prompts, dtype=dtype, quantization="fp8",
                                max_num_batched_tokens=step_tokens, enforce_eager=True)

    reference = run("float32", w8a8=True)  # fp32 activations: the dense path
    kernel_error = (run("bfloat16", w8a8=True) - reference).abs().mean().item()
    assert calls and all(rows <= step_tokens for rows in calls)
    scaled_mm_error = (run("bfloat16", w8a8=False) - reference).abs().mean().item()
    print(f"mean |logprob - fp32|: fp8_w8a8 {kernel_error:.4f}, _scaled_mm {scaled_mm_error:.4f}")
    # The same fp8 operands, both accumulating without fp32 promotion: as close as cuBLAS.
    assert kernel_error <= 1.5 * scaled_mm_error + 1e-3


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_fused_norms_decode_like_the_unfused_chain(save_hf_model, monkeypatch, quantization):
    """Decode at one row fuses each RMSNorm into the linears around it (PendingNorm): o_proj
    and down leave the norm pending, gate/up (16384 rows, a wide linear: int4 on mma.sync, fp8
    on the byte kernel) and qkv (int4: the word kernel; fp8: mma.sync) finish it. Each decode
    run is scored against the unfused engine's teacher-forced logprobs of the tokens it chose;
    the fused run is as close as the unfused decode is."""
    from kvserve.quantization.int4 import Int4Linear

    linear_class = Int4Linear if quantization == "int4" else Fp8Linear
    model_dir, prompts = _random_llama(save_hf_model, 1, (9, 33), hidden_size=512, intermediate_size=8192,
                                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    add_norm_matmul = linear_class.add_norm_matmul
    fused_calls = []

    def counted(self, *args):
        pending = add_norm_matmul(self, *args)
        fused_calls.append(pending is not None)
        return pending

    def llm(fused: bool) -> LLM:
        monkeypatch.setattr(linear_class, "add_norm_matmul", counted if fused else lambda self, *args: None)
        return LLM(model=model_dir, dtype="bfloat16", device="cuda", quantization=quantization,
                   quantization_config={"lm_head": False}, gpu_memory_utilization=0.3)

    def decode(engine: LLM) -> list[tuple[list[int], list[float]]]:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
        runs = []
        for prompt in prompts:  # one sequence a step: the one-row kernels
            out = engine.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
            runs.append((out.token_ids, [entry[token] for token, entry in zip(out.token_ids, out.logprobs)]))
        return runs

    def engine_run(fused: bool) -> list[tuple[list[int], list[float]]]:
        engine = llm(fused)
        runs = decode(engine)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        return runs

    fused_runs, unfused_runs = engine_run(True), engine_run(False)
    assert any(fused_calls), "no linear took the fused norm"
    reference = llm(False)  # teacher-forced: prefill rows, never the one-row kernels
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def error(runs) -> float:
        diffs = []
        for prompt, (tokens, logprobs) in zip(prompts, runs, strict=True):
            scored = reference.generate([{"prompt_token_ids": prompt + tokens}], params)[0]
            forced = [entry[token] for token, entry in zip(scored.prompt_token_ids[len(prompt):],
                                                           scored.prompt_logprobs[len(prompt):])]
            diffs += [abs(a - b) for a, b in zip(logprobs, forced, strict=True)]
        return sum(diffs) / len(diffs)

    fused_error, unfused_error = error(fused_runs), error(unfused_runs)
    print(f"mean |decode logprob - teacher-forced|: fused {fused_error:.4f}, unfused {unfused_error:.4f}")
    assert fused_error <= 2 * unfused_error + 2e-3


def test_fp8_rows_from_the_norm_and_swiglu_kernels_change_no_bit(save_hf_model, monkeypatch):
    """At 2-128 rows on Hopper the RMSNorm and SwiGLU kernels before qkv, gate/up and down
    quantize their own output (Fp8Rows) for fp8_w8a8: the same bits as each linear quantizing
    its input. Prefill chunks of 12 and 100 rows (eager) and a batch of 6 decoding through
    CUDA graphs give the same logprobs with the fused quantization as without it."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("fp8_w8a8 runs on Hopper")
    from kvserve.ops.quant.fp8_rows import Fp8Rows

    model_dir, prompts = _random_llama(save_hf_model, 3, (30, 75, 140, 9, 50, 21), hidden_size=512,
                                       intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8,
                                       num_key_value_heads=2)
    fp8_rows_inputs = []
    apply = Fp8Linear.apply

    def counted(self, x):
        fp8_rows_inputs.append(isinstance(x, Fp8Rows))
        return apply(self, x)

    monkeypatch.setattr(Fp8Linear, "apply", counted)

    def run() -> tuple[torch.Tensor, ...]:
        scored = [_prompt_logprobs(model_dir, prompts, quantization="fp8", max_num_batched_tokens=step,
                                   enforce_eager=True) for step in (12, 100)]
        llm = LLM(model=model_dir, device="cuda", quantization="fp8", quantization_config={"lm_head": False},
                  gpu_memory_utilization=0.3)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
        del llm
        gc.collect()
        decoded = torch.tensor([[entry[token] for token, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                for o in outputs])
        return *scored, decoded

    fused = run()
    assert sum(fp8_rows_inputs) > 0
    fp8_rows_inputs.clear()
    monkeypatch.setattr(Fp8Linear, "takes_fp8_rows", lambda self, rows, dtype: False)
    unfused = run()
    assert sum(fp8_rows_inputs) == 0
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)
