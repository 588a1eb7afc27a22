"""Where a decoder layer's RMSNorms run inside the dense linears around them (PendingNorm,
RMSNorm.add_after): the decision for each pair of layers, and tiny bf16 models' decode
steps with and without the fusion.

The dense GEMV that fuses them runs on Hopper only (dense_gemv.applies / takes_row); off the
GPU no step would ever take it, so here those two decisions are told to take CPU rows and
the kernels run under Triton's interpreter. Everything else decides as it would on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.linear import Linear
from kvserve.model_executor.layers.moe import SparseMoE
from kvserve.ops import dense_gemv
from kvserve.ops.pending_norm import PendingNorm
from tests.triton_interpreter import run_interpreted

DTYPE = torch.bfloat16


def take_cpu_rows(patch) -> None:
    """dense_gemv's decisions as on an H200, for CPU tensors (`patch(target, name, value)`:
    monkeypatch.setattr, or setattr in a subprocess): bf16/fp16 one-row x, weight
    contiguous in its dtype."""
    def takes_row(dtype: torch.dtype, weight: torch.Tensor) -> bool:
        return dtype in (torch.bfloat16, torch.float16) and weight.dtype == dtype and weight.is_contiguous()

    patch(dense_gemv, "takes_row", takes_row)
    patch(dense_gemv, "applies", lambda x, weight: x.numel() == weight.shape[1] and takes_row(x.dtype, weight))


def _pair(hidden: int = 48, producer_bias: bool = False) -> tuple[Linear, RMSNorm, Linear]:
    torch.manual_seed(0)
    producer = Linear(32, hidden, bias=producer_bias).to(DTYPE)
    norm = RMSNorm(hidden).to(DTYPE)
    consumer = Linear(hidden, 24, bias=True).to(DTYPE)
    return producer, norm, consumer


class _Wrapped(nn.Module):
    """A module around a linear that offers neither method (as a LoRA or tensor-parallel
    wrapper): it must never be handed a PendingNorm."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _moe(hidden: int = 48) -> SparseMoE:
    """A packed bf16 mixture (8 experts, top 2) of hidden size `hidden`."""
    torch.manual_seed(0)
    layer = SparseMoE(hidden, 32, 8, 2, True)
    with torch.no_grad():
        layer.gate.weight.normal_(0, hidden**-0.5)  # a Router starts empty()
    layer = layer.to(DTYPE)
    assert layer.pack_experts()
    return layer


def take_cpu_moe(patch) -> None:
    """SparseMoE.folds_pending_norm as on a GPU, for packed CPU stacks (`patch` as
    take_cpu_rows')."""
    patch(SparseMoE, "folds_pending_norm", lambda self, rows, dtype: self.packed and self._fused_kernels_take(rows, dtype))


def test_dense_linear_fuses_its_norm_with_a_mixture_not_with_another_linear(monkeypatch) -> None:
    producer, norm, consumer = _pair()
    moe = _moe()
    row, hidden_row = torch.randn(1, 32, dtype=DTYPE), torch.randn(1, 48, dtype=DTYPE)
    # Off the GPU (the real decision): never.
    assert not consumer.folds_pending_norm(1, DTYPE)
    assert not norm.fuses_into(producer, moe, row) and not norm.fuses_into(moe, consumer, hidden_row)
    take_cpu_rows(monkeypatch.setattr)
    take_cpu_moe(monkeypatch.setattr)
    assert consumer.folds_pending_norm(1, DTYPE) and moe.folds_pending_norm(1, DTYPE)
    assert norm.fuses_into(producer, moe, row)  # o_proj -> the mixture
    assert norm.fuses_into(moe, consumer, hidden_row)  # the mixture -> the next layer's q/k/v
    # Two dense GEMVs keep the norm's own kernel, though each would take part.
    assert not norm.fuses_into(producer, consumer, row)
    # Not for two rows, fp32 rows, a consumer that is not a layer taking part, or with the switch off.
    assert not norm.fuses_into(moe, consumer, torch.randn(2, 48, dtype=DTYPE))
    assert not norm.fuses_into(producer.float(), moe, torch.randn(1, 32))
    for other in (None, _Wrapped(moe), nn.Linear(48, 24).to(DTYPE)):
        assert not norm.fuses_into(producer, other, row)
    assert not norm.fuses_into(_Wrapped(producer), moe, row)
    monkeypatch.setenv("KVSERVE_FUSED_NORMS", "0")
    assert not norm.fuses_into(producer, moe, row)


def test_quantized_linears_still_take_part() -> None:
    """The protocols RMSNorm.add_after asks for: QuantizedLinear and Linear offer both
    methods, a wrapper around one neither."""
    from kvserve.model_executor.layers.layernorm import _is_consumer, _is_producer
    from kvserve.quantization.int4 import Int4Linear, quantize_int4

    quantized = Int4Linear(*quantize_int4(torch.randn(16, 64), 32), 32, None)
    for layer in (quantized, Linear(4, 4)):
        assert _is_producer(layer) and _is_consumer(layer)
        assert not _is_producer(_Wrapped(layer)) and not _is_consumer(_Wrapped(layer))


def test_producer_declines_with_a_bias_or_an_unsuitable_residual(monkeypatch) -> None:
    """add_norm_matmul writes nothing and returns None where the GEMV's epilogue cannot
    take the add: a bias, a residual that is not one contiguous [1, N] row of x's dtype, a
    norm weight in another dtype; add_after then runs the unfused layers."""
    plain_applies = dense_gemv.applies
    take_cpu_rows(monkeypatch.setattr)
    take_cpu_moe(monkeypatch.setattr)
    producer, norm, _ = _pair(producer_bias=True)
    consumer = _moe()
    x, residual = torch.randn(1, 32, dtype=DTYPE), torch.randn(1, 48, dtype=DTYPE)
    before = residual.clone()
    assert producer.add_norm_matmul(x, residual, norm.weight, norm.eps) is None
    plain, _, _ = _pair()
    assert plain.add_norm_matmul(x, torch.randn(2, 48, dtype=DTYPE), norm.weight, norm.eps) is None
    assert plain.add_norm_matmul(x, torch.randn(1, 96, dtype=DTYPE)[:, ::2], norm.weight, norm.eps) is None
    assert plain.add_norm_matmul(x, residual.float(), norm.weight, norm.eps) is None
    assert plain.add_norm_matmul(x, residual, norm.weight.float(), norm.eps) is None
    assert torch.equal(residual, before)
    # The pair still fuses by the consumer's decision; the producer declines, and the layers
    # run unfused (on CPU's torch path: no GEMV takes a CPU row).
    assert norm.fuses_into(producer, consumer, x)
    monkeypatch.setattr(dense_gemv, "applies", plain_applies)
    out, stream = norm.add_after(producer, x, residual, consumer)
    expected_stream = before + producer(x)
    assert isinstance(out, torch.Tensor) and torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, norm(expected_stream))


def test_a_dense_linear_that_declines_finishes_a_pending_norm() -> None:
    """A PendingNorm reaching a dense Linear whose GEMV does not take it (here: on CPU)
    is finished first."""
    torch.manual_seed(1)
    h = torch.randn(1, 48)
    pending = PendingNorm(h * 1.5, (h * h).sum(-1, keepdim=True), 1e-5)
    layer = Linear(48, 8)
    torch.testing.assert_close(layer(pending), layer(pending.finish()))


# Tiny bf16 models of two layers: a dense Llama, and a Qwen3-MoE (8 experts, top 2).
CONFIGS = {
    "llama": dict(architecture="LlamaForCausalLM", intermediate_size=80),
    "qwen3-moe": dict(architecture="Qwen3MoeForCausalLM", intermediate_size=80, qk_norm=True, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32),
}


def decode_step(name: str) -> None:
    """Subprocess entry (interpreter): CONFIGS[name] prefills 5 tokens and decodes one, fused
    and unfused; prints the norms each decode left pending and the decode logits' relative
    difference. A mixture of experts takes CPU rows too (its packed stacks stand in for CUDA
    ones)."""
    import os

    from kvserve.config import ModelConfig
    from kvserve.model_executor.models.llama import LlamaForCausalLM
    from tests.model_executor.conftest import PagedRunner

    take_cpu_rows(setattr)
    take_cpu_moe(setattr)
    fused_calls = []

    def counted(add_norm_matmul):
        def add_norm_matmul_counted(self, *args):
            pending = add_norm_matmul(self, *args)
            fused_calls.append(pending is not None)
            return pending
        return add_norm_matmul_counted

    Linear.add_norm_matmul = counted(Linear.add_norm_matmul)
    SparseMoE.add_norm_matmul = counted(SparseMoE.add_norm_matmul)
    config = ModelConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, dtype=DTYPE, **CONFIGS[name])
    results = {}
    for switch in ("1", "0"):
        os.environ["KVSERVE_FUSED_NORMS"] = switch
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("norm.weight"):
                    parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
                elif parameter_name.endswith("gate.weight"):  # routers of Router's empty()
                    parameter.normal_(0, 64**-0.5)
            # The embedding is built empty (a checkpoint fills it). A residual stream of
            # mean square far from 1: a norm factor left out shows.
            model.model.embed_tokens.weight.normal_(0, 6)
        model = model.to(DTYPE)
        for module in model.modules():
            if isinstance(module, SparseMoE):
                assert module.pack_experts()
        runner = PagedRunner(model, config)
        runner.step([(0, [3, 14, 15, 92, 65])])
        fused_calls.clear()
        results[switch] = (runner.step([(0, [35])])[0].float(), sum(fused_calls))
    (fused, fused_count), (unfused, unfused_count) = results["1"], results["0"]
    print(json.dumps({"fused": fused_count, "unfused": unfused_count,
                      "difference": ((fused - unfused).norm() / unfused.norm()).item()}))


@pytest.mark.parametrize(("name", "fused"), [("llama", 0), ("qwen3-moe", 3)])
def test_interpreted_tiny_model_decode_runs_its_norms_in_the_layers(name, fused) -> None:
    """A Qwen3-MoE decode row fuses each norm between a linear and the mixture: the
    post-attention norm (o_proj -> the mixture) and the next layer's input norm (the mixture
    -> q/k/v), 2 layers x 2 - the final norm before the LM head = 3; a dense Llama's, each
    between two dense GEMVs, keep their kernels. The logits are the unfused step's within
    bf16 rounding; KVSERVE_FUSED_NORMS=0 fuses none."""
    result = json.loads(run_interpreted("tests.model_executor.test_fused_norms", "decode_step", name))
    assert (result["fused"], result["unfused"]) == (fused, 0)
    assert result["difference"] <= 1e-2, result
