"""Programmatic dependent launch: a GEMV that starts before the kernel it depends on has
finished must still read that kernel's output. The decode step's chain (RMSNorm -> int4 or
fp8 GEMV -> SiLU-and-mul -> GEMV) is captured in a CUDA graph with PDL and replayed on fresh
inputs; every replay must equal the chain run eagerly without PDL (the same kernels and
summation order, so bit for bit). fp8 runs its word kernel, the one that launches early.
Then the whole engine: every kernel of a decode step chained under PDL, against PDL off."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.ops import pdl
from kvserve.ops.elementwise import add_rms_norm, silu_and_mul
from kvserve.quantization.fp8 import Fp8Linear, quantize_fp8
from kvserve.quantization.int4 import Int4Linear, quantize_int4

HIDDEN, INTERMEDIATE = 4096, 7168


def _layer(kind: str, n: int, k: int, seed: int):
    weight = torch.randn(n, k, generator=torch.Generator("cuda").manual_seed(seed), device="cuda") * 0.05
    if kind == "int4":
        return Int4Linear(*quantize_int4(weight, 128), 128, None)
    q, scale = quantize_fp8(weight)
    return Fp8Linear(q, scale[:, None], None)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_gemvs_launched_early_read_their_inputs(kind, monkeypatch) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    assert pdl.enabled(torch.device("cuda"))
    if kind == "fp8":
        # One fp8 row takes mma.sync (no PDL) where it applies; the word kernel, which
        # launches early, only where it does not: force it here.
        from kvserve.ops.quant.weight_only import configs, matmul

        monkeypatch.setattr(matmul, "default_config", lambda *args, **kwargs: configs.FP8_ONE_ROW_WORDS_CONFIG)
    gate_up = _layer(kind, 2 * INTERMEDIATE, HIDDEN, 0)
    down = _layer(kind, HIDDEN, INTERMEDIATE, 1)
    norm_weight = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return down(silu_and_mul(gate_up(add_rms_norm(x, norm_weight, 1e-5, residual))))

    static_x = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    static_residual = torch.zeros_like(static_x)
    chain(static_x, static_residual)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = chain(static_x, static_residual)
    for seed in range(5):
        generator = torch.Generator("cuda").manual_seed(100 + seed)
        x = torch.randn(1, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
        residual = torch.randn(1, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
        static_x.copy_(x)
        static_residual.copy_(residual)
        graph.replay()
        with monkeypatch.context() as patch:
            patch.setenv("KVSERVE_PDL", "0")
            expected = chain(x, residual.clone())
        assert torch.equal(static_y, expected), f"replay {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "int4", "fp8"])
def test_decode_steps_with_pdl_equal_the_steps_without(save_hf_model, quantization, monkeypatch) -> None:
    """The whole chain (norms, RoPE, the KV write, attention, the GEMVs on every kernel a
    decode row count picks, argmax) replayed from CUDA graphs with PDL gives the tokens and
    logprobs of the same engine with PDL off, bit for bit. gate/up is 16384 wide, so one
    row of int4 takes mma.sync and one row of fp8 the byte kernel."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=8192, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model_dir = save_hf_model(LlamaForCausalLM(config).to(torch.bfloat16))
    generator = torch.Generator().manual_seed(3)
    # Staggered lengths: decode steps of 4, 3, 2 and 1 rows as the shorter requests finish.
    prompts = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (5, 30, 77, 200)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (8, 16, 24, 40)]
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("KVSERVE_PDL", setting)
        llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", quantization=quantization,
                  max_num_seqs=4, gpu_memory_utilization=0.3)
        assert llm.engine.core.runner.cuda_graphs is not None
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.core.runner.cuda_graphs.num_replays > 0
        results[setting] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results["1"] == results["0"]
