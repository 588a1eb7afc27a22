"""`--quantization auto` (serve's default) on CPU: what it picks for the embedded Q4_1 GGUF,
checked against the fp32 dequantized weights and logits as the reference."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from kvserve.quantization import cpu_plan
from kvserve.quantization.cpu_plan import apply_plan, bf16_gemm_speedup, resolve_auto_quantization
from kvserve.engine.engine_args import CPU_MAX_NUM_BATCHED_TOKENS, EngineArgs
from kvserve.entrypoints.openai.cli_args import add_cli_args as add_serve_args
from kvserve.model_executor.loader import load_model
from kvserve.quantization.base import QuantizedLinear

CPU = torch.device("cpu")


def _load_with_plan(path: str, bf16_speedup: float):
    """The embedded model under the auto plan a CPU with this measured bf16 speedup gets."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_plan, "measured_bf16_speedup", lambda *shape: bf16_speedup)
        loaded = load_model(path, dtype=torch.float32)
        plan = resolve_auto_quantization(loaded, CPU)
    apply_plan(loaded, plan)
    return plan, loaded


# Both CPU kinds, whichever this machine is: fp32 GEMMs fastest (no bf16 dot products) and
# bf16 ones ~2x fp32 (AVX512-BF16; AMX measures 3-5x and gets the same plan).
@pytest.fixture(scope="module", params=[0.01, 1.9], ids=["fp32-cpu", "bf16-cpu"])
def auto_loaded(request, smollm2_path):
    return _load_with_plan(smollm2_path, request.param)


@pytest.mark.parametrize("speedup,dense_dtype", [
    (0.01, torch.float32),  # no bf16 dot products: bf16 GEMMs emulated
    (1.2, torch.float32),
    (1.9, torch.bfloat16),  # AVX512-BF16 (2-core EPYC: 1.9-2.4x)
    (4.5, torch.bfloat16),  # AMX
])
def test_dense_copies_are_bf16_where_the_cpu_has_bf16_dot_products(smollm2_loaded, monkeypatch, speedup, dense_dtype):
    monkeypatch.setattr(cpu_plan, "measured_bf16_speedup", lambda *shape: speedup)
    plan = resolve_auto_quantization(smollm2_loaded, CPU)
    assert plan.dense_dtype == dense_dtype
    assert ("bf16 dot products" in plan.reasons[1]) == (dense_dtype == torch.bfloat16)


def test_plan_for_the_q4_1_gguf_and_elsewhere(auto_loaded):
    plan, loaded = auto_loaded
    assert (plan.quantization, plan.quantization_config) == ("int4", {"group_size": 32, "lm_head": False})
    assert plan.keep_dense_weights and plan.quantize_lm_head and plan.reasons
    bf16 = plan.dense_dtype == torch.bfloat16
    assert plan.linear_kernel_max_rows == (cpu_plan.BF16_FROM_ROWS if bf16 else cpu_plan.INT4_FP32_FROM_ROWS)
    assert plan.head_kernel_max_rows == (cpu_plan.BF16_FROM_ROWS if bf16 else 16)
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
        dense = module.dense_weight.plain()
        assert torch.equal(dense, reference[name].weight.to(auto_loaded[0].dense_dtype)), name
        assert torch.allclose(module.dequantize(), reference[name].weight, rtol=0, atol=1e-6), name


def test_int8_lm_head_tracks_the_fp32_logits(auto_loaded, smollm2_loaded):
    plan, loaded = auto_loaded
    torch.manual_seed(0)
    embed = smollm2_loaded.model.model.embed_tokens.weight
    # Realistic final hidden states: the model's own, for a few random tokens.
    hidden = smollm2_loaded.model.model.norm(embed[torch.randint(0, embed.shape[0], (8,))] * 30)
    reference = torch.nn.functional.linear(hidden, embed)
    assert loaded.model.quantized_lm_head is not None
    for rows in (1, plan.head_kernel_max_rows, 8):
        logits = loaded.model.compute_logits(hidden[:rows])
        scale = reference[:rows].abs().amax(dim=-1, keepdim=True)
        assert ((logits - reference[:rows]).abs() / scale).max() < 0.03, rows
        assert torch.equal(logits.argmax(-1), reference[:rows].argmax(-1)), rows
    # Larger inputs take the dense head in the plan's dtype: exactly that matmul.
    many = hidden.repeat(4, 1)
    dense = torch.nn.functional.linear(many.to(plan.dense_dtype), embed.to(plan.dense_dtype)).float()
    assert torch.equal(loaded.model.compute_logits(many), dense)


def test_rows_up_to_the_plans_limit_take_the_int4_kernel_more_the_dense_copy(auto_loaded):
    plan, loaded = auto_loaded
    limit = plan.linear_kernel_max_rows
    torch.manual_seed(2)
    for module in (loaded.model.model.layers[0].mlp.gate_up_proj, loaded.model.model.layers[3].self_attn.o_proj):
        assert module.cpu_kernel_max_rows == limit
        x = torch.randn(limit + 1, module.in_features)
        assert torch.equal(module(x[:limit]), module.kernel_matmul(x[:limit]))
        assert torch.equal(module(x), module.dense_weight.linear(x))


def test_prefill_with_the_plans_dense_weights_tracks_fp32(auto_loaded, smollm2_loaded):
    """A 48-token prompt (prefill-sized: the dense path) through the planned model against the
    fp32 dequantized model: packed fp32 dense weights give the same logits up to the order of
    sums; bf16 ones (bf16 activations too) move them by about bf16's precision over 30
    layers, and random tokens are full of near-ties (measured: <= 4.7% of the row's largest
    logit, 92-94% top-1)."""
    plan, loaded = auto_loaded
    torch.manual_seed(1)
    token_ids = torch.randint(0, 49152, (48,))
    logits, reference = (_prefill_logits(m, token_ids) for m in (loaded.model, smollm2_loaded.model))
    scale = reference.abs().amax(dim=-1, keepdim=True)
    if plan.dense_dtype == torch.float32:
        assert ((logits - reference).abs() / scale).max() < 1e-4  # measured 5e-6
        assert torch.equal(logits.argmax(-1), reference.argmax(-1))
        return
    assert ((logits - reference).abs() / scale).max() < 0.08
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.85


def _prefill_logits(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    from kvserve.attention.metadata import AttentionMetadata

    n, config, block_size = len(token_ids), model.config, 16
    num_blocks = -(-n // block_size)
    caches = [torch.zeros(2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
              for _ in range(config.num_hidden_layers)]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], block_size=block_size,
        max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n],
    )
    with torch.inference_mode():
        hidden = model(token_ids, torch.arange(n), caches, metadata)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def q8_0_path(smollm2_path, tmp_path_factory):
    """SmolLM2 with its Q4_1 linears requantized to Q8_0 by gguf's own quantizer: a real Q8_0
    file (the tied embedding was Q8_0 already)."""
    from gguf import GGMLQuantizationType

    from kvserve.benchmarks.gguf_requantize import requantize

    path = str(tmp_path_factory.mktemp("q8_0") / "smollm2-q8_0.gguf")
    requantize(smollm2_path, path, GGMLQuantizationType.Q8_0)
    return path


def test_q8_0_gguf_becomes_int8_groups_holding_its_grid_exactly(q8_0_path):
    """The Q8_0 file's plan: int8 with 32-wide groups (the file's blocks, exactly: against the
    gguf package's dequantization in the fp32 load), the kernel for up to 16 rows on a CPU
    whose fp32 GEMMs are the fast ones, the dense copy past that."""
    plan, loaded = _load_with_plan(q8_0_path, 0.01)
    assert (plan.quantization, plan.quantization_config) == ("int8", {"group_size": 32, "lm_head": False})
    assert plan.dense_dtype == torch.float32 and plan.linear_kernel_max_rows == 16
    fp32 = load_model(q8_0_path, dtype=torch.float32)
    reference = dict(fp32.model.named_modules())
    quantized = [(name, m) for name, m in loaded.model.named_modules()
                 if isinstance(m, QuantizedLinear) and name != "quantized_lm_head"]
    assert len(quantized) == 30 * 4
    for name, module in quantized:
        assert module.group_size == 32 and module.cpu_kernel_max_rows == 16
        assert torch.equal(module.dequantize(), reference[name].weight), name
    module = loaded.model.model.layers[2].mlp.down_proj
    x = torch.randn(17, module.in_features)
    assert torch.equal(module(x[:16]), module.kernel_matmul(x[:16]))
    assert torch.equal(module(x), module.dense_weight.linear(x))
    fp32.gguf_tensor_types["blk.0.attn_q.weight"] = "Q4_1"  # a file of mixed types: its own blocks
    assert resolve_auto_quantization(fp32, CPU).quantization == cpu_plan.PACKED_GGUF
    fp32.gguf_tensor_types["blk.0.attn_q.weight"] = "IQ4_XS"  # a type kvserve does not pack: fp32
    assert resolve_auto_quantization(fp32, CPU).quantization is None
    # A mixture's experts count among the linears, in each of llama.cpp's layouts.
    for expert_tensor in ("blk.0.ffn_down_exps.weight", "blk.0.ffn_up.3.weight", "blk.1.ffn_gate_shexp.weight"):
        types = dict(fp32.gguf_tensor_types, **{"blk.0.attn_q.weight": "Q8_0", expert_tensor: "Q6_K"})
        plan = resolve_auto_quantization(dataclasses.replace(fp32, gguf_tensor_types=types), CPU)
        assert plan.quantization == cpu_plan.PACKED_GGUF, expert_tensor


def test_bf16_probe_measures_this_cpu():
    assert bf16_gemm_speedup(64, 128, rows=8) > 0


def test_bf16_probe_is_measured_once_per_cpu_threads_and_shape(tmp_path, monkeypatch):
    """Kept under $KVSERVE_CACHE_DIR: a second start reads the first one's ratio (here 2.01,
    just over the threshold, where two measurements could fall either side); another thread
    count or shape measures again; an unreadable file is measured over."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    measured = iter([2.01, 1.5, 3.0, 0.5])
    calls = []
    monkeypatch.setattr(cpu_plan, "bf16_gemm_speedup", lambda *shape: calls.append(shape) or next(measured))
    assert cpu_plan.measured_bf16_speedup(576, 1536) == 2.01
    assert cpu_plan.measured_bf16_speedup(576, 1536) == 2.01 and len(calls) == 1
    assert cpu_plan.measured_bf16_speedup(576, 3072) == 1.5 and len(calls) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cpu_plan.measured_bf16_speedup(576, 1536) == 3.0
    finally:
        torch.set_num_threads(threads)
    assert cpu_plan.measured_bf16_speedup(576, 1536) == 2.01 and len(calls) == 3
    (tmp_path / "cpu_probes.json").write_text("{not json")
    assert cpu_plan.measured_bf16_speedup(576, 1536) == 0.5 and len(calls) == 4


def test_serve_defaults_are_auto_and_per_device_chunk():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert args.quantization == "auto" and args.max_num_batched_tokens is None
    assert args.compile_decode is None  # on where it applies (tests/model_executor/test_compiled_decode.py)
    assert args.resolved_max_num_batched_tokens(CPU) == CPU_MAX_NUM_BATCHED_TOKENS
    assert args.resolved_max_num_batched_tokens(torch.device("cuda")) == 2048
    explicit = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "none",
                                                           "--max-num-batched-tokens", "1024",
                                                           "--no-compile-decode"]))
    assert explicit.quantization == "none" and explicit.resolved_max_num_batched_tokens(CPU) == 1024
    assert explicit.compile_decode is False


@pytest.mark.parametrize("quantization", ["auto", "none", "int8"])
def test_benchmarks_load_the_model_as_an_engine_would(smollm2_path, quantization):
    """load_engine_model (what `bench prefix` and `bench spec-decode` load once for several
    engines) applies "auto"'s plan and reads "none" as no quantization, as LLMEngine does;
    before it, those benchmarks passed "auto" to load_model, which rejected it."""
    from kvserve.engine.core import load_engine_model

    loaded = load_engine_model(EngineArgs(model=smollm2_path, quantization=quantization))
    kinds = {type(m).__name__ for m in loaded.model.modules() if isinstance(m, QuantizedLinear)}
    # auto on this Q4_1 file: int4 linears and an int8 copy of the LM head.
    assert kinds == {"auto": {"Int4Linear", "Int8Linear"}, "none": set(), "int8": {"Int8Linear"}}[quantization]


def test_auto_runs_a_gguf_too_large_to_dequantize_from_its_packed_blocks(smollm2_path, monkeypatch, caplog):
    """auto keeps the fp32 dequantized model (0.54 GB for SmolLM2's 135M parameters). With
    1 GB available that is more than half, so it loads the file's packed blocks instead
    (quantization=gguf: no fp32 copies) and says why; with 2 GB, its usual plan."""
    import logging

    from kvserve.engine.core import load_engine_model

    monkeypatch.setattr(cpu_plan, "available_memory_bytes", lambda: 10**9)
    with caplog.at_level(logging.WARNING):
        loaded = load_engine_model(EngineArgs(model=smollm2_path, quantization="auto"))
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.dense_weight is None for m in linears)
    assert "0.5 GB in fp32" in caplog.text and "running the GGUF's packed blocks" in caplog.text
    monkeypatch.setattr(cpu_plan, "available_memory_bytes", lambda: 2 * 10**9)
    planned = load_engine_model(EngineArgs(model=smollm2_path, quantization="auto"))
    assert any(m.dense_weight is not None for m in planned.model.modules() if isinstance(m, QuantizedLinear))


def test_available_memory_is_read_from_the_system():
    available = cpu_plan.available_memory_bytes()
    assert available is not None and 0 < available < 2**50


# A Q4_K_M-style mix: Q4_K with a Q6_K v (so the fused q/k/v layer stacks two types) and Q5_K
# down projections (offsets), rows a multiple of 256 as K-quants need.
_K_QUANT_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
                "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q5_K"}


def test_a_k_quant_gguf_runs_from_its_own_blocks(tmp_path, monkeypatch):
    """No re-quantization reproduces K-quant sub-block scales, so auto packs the file's own
    blocks (int4 where a layer is all Q4_K, int5 for Q5_K, int8 groups with offsets otherwise),
    keeps their exact dequantization as the dense copy, and its decode rows run the kernels: against the
    fp32 dequantized model (gguf-py's values: test_gguf_packed), weights exactly and logits
    to the kernels' int16 rounding of x."""
    from gguf import GGMLQuantizationType as T

    from kvserve.engine.core import load_engine_model
    from kvserve.ops.cpu import int4_matmul_op, int8_matmul_op
    from kvserve.quantization.int4 import Int4Linear
    from kvserve.quantization.int5 import Int5Linear
    from kvserve.quantization.int8 import GroupInt8Linear
    from tests.quantization.test_gguf_packed import write_tiny_llama

    path = str(tmp_path / "k-quants.gguf")
    write_tiny_llama(path, {part: T[name] for part, name in _K_QUANT_MIX.items()})
    monkeypatch.setattr(cpu_plan, "measured_bf16_speedup", lambda *shape: 0.01)
    loaded = load_engine_model(EngineArgs(model=path, quantization="auto", skip_tokenizer_init=True))
    reference = load_model(path, dtype=torch.float32, skip_tokenizer_init=True)
    plan = resolve_auto_quantization(reference, CPU)
    assert plan.quantization == cpu_plan.PACKED_GGUF and plan.quantization_config is None
    assert "Q4_K/Q5_K/Q6_K" in plan.reasons[0]
    modules = dict(reference.model.named_modules())
    layer = loaded.model.model.layers[1]
    qkv, o, gate_up, down = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj)
    assert isinstance(o, Int4Linear) and isinstance(gate_up, Int4Linear) and o.cpu_kernel_max_rows == 8
    assert isinstance(qkv, GroupInt8Linear) and qkv.group_size == 16 and qkv.offset is not None
    assert (qkv.own_kernel is not None) == (int8_matmul_op() is not None)
    assert qkv.cpu_kernel_max_rows == 16
    if int4_matmul_op() is not None:  # Q5_K on the int4 kernel, to its row limit
        assert isinstance(down, Int5Linear) and down.group_size == 32 and down.cpu_kernel_max_rows == 8
    for name, module in loaded.model.named_modules():
        if isinstance(module, QuantizedLinear) and name != "quantized_lm_head":
            assert torch.equal(module.dequantize(), modules[name].weight), name
            assert torch.equal(module.dense_weight.plain(), modules[name].weight), name
    token_ids = torch.tensor([3, 17, 5, 29])  # 4 rows: the kernels
    logits, expected = (_prefill_logits(m, token_ids) for m in (loaded.model, reference.model))
    scale = expected.abs().amax(dim=-1, keepdim=True)
    # Measured 1.0e-3: each layer's x rounded to int16 (2^-16 of its row's largest value).
    assert ((logits - expected).abs() / scale).max() < 4e-3
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    x = torch.randn(17, down.in_features)  # past every limit: the dense copy, exactly
    assert torch.equal(down(x), down.dense_weight.linear(x))


def test_a_tensor_parallel_rank_keeps_its_k_quant_share_in_fp32(tmp_path):
    """A rank holds slices of the linears, which the file's blocks do not make: its share of a
    K-quant GGUF stays fp32 under auto (as every such file did before), where applying the plan
    without packed layers would fail."""
    from gguf import GGMLQuantizationType as T

    from kvserve.model_executor.tensor_parallel import quantize_shard
    from tests.quantization.test_gguf_packed import write_tiny_llama

    path = str(tmp_path / "k-quants.gguf")
    write_tiny_llama(path, {part: T[name] for part, name in _K_QUANT_MIX.items()})
    loaded = load_model(path, dtype=torch.float32, skip_tokenizer_init=True)
    weights = {name: p.clone() for name, p in loaded.model.named_parameters()}
    quantize_shard(loaded, "auto", None, CPU)
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    assert all(torch.equal(p, weights[name]) for name, p in loaded.model.named_parameters())
