"""Each weight-only method against independent references: round-trip error within the
method's bound on odd shapes, and the layer's matmul equal to (reference dequantized
weight) @ x on both the CPU kernel path (few rows) and the dense path (many rows)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from torch import nn

from kvserve.engine.engine_args import EngineArgs
from kvserve.model_executor.loader import load_model
from kvserve.quantization import QuantizedLinear, get_quantization_method
from kvserve.quantization.base import CPU_KERNEL_MAX_ROWS
from kvserve.quantization.int4 import fits_fp16
from kvserve.quantization.int8 import GroupInt8Linear

# bitsandbytes' published NF4 table (bitsandbytes/functional.py, get_4bit_type("nf4")).
BNB_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020635843277, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
ROW_COUNTS = (1, 3, CPU_KERNEL_MAX_ROWS, CPU_KERNEL_MAX_ROWS + 1, 64)


def _linear(out_features: int, in_features: int, seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        layer.weight[0, :7] *= 20  # outliers, as real checkpoints have
    return layer


def _quantize(method: str, layer: nn.Linear, **config) -> QuantizedLinear:
    return get_quantization_method(method, config or None).quantize_linear("layer", layer)


def _check_matmul(quantized: QuantizedLinear, reference_weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for rows in ROW_COUNTS:
        x = torch.randn(rows, quantized.in_features)
        expected = x @ reference_weight.T + (0 if bias is None else bias)
        got = quantized(x)
        # Few rows may run a kernel with bf16 activations (8 mantissa bits): a few 1e-3.
        tolerance = 1e-2 if rows <= CPU_KERNEL_MAX_ROWS else 1e-5
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("shape", [(37, 51), (96, 160), (200, 576)])
def test_int8_round_trip_and_matmul(shape):
    layer = _linear(*shape, seed=1)
    quantized = _quantize("int8", layer)
    weight = layer.weight.detach()
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    reference = torch.round(weight / step) * step
    assert (quantized.dequantize() - weight).abs().le(step / 2 + 1e-7).all()
    torch.testing.assert_close(quantized.dequantize(), reference, rtol=0, atol=1e-6)
    assert quantized.weight_bytes() < weight.numel() * 4 / 3.5
    _check_matmul(quantized, reference, layer.bias.detach())


@pytest.mark.parametrize("shape, group_size", [((37, 64), 32), ((200, 576), 32), ((9, 48), 16), ((5, 60), 12)])
def test_int8_groups_round_trip_and_matmul(shape, group_size):
    """quantization_config={"group_size": N}: one scale per N columns (GroupInt8Linear); 12-wide
    groups have no kernel and compute on the dequantized weight."""
    layer = _linear(*shape, seed=2)
    quantized = _quantize("int8", layer, group_size=group_size)
    assert isinstance(quantized, GroupInt8Linear) and quantized.group_size == group_size
    weight = layer.weight.detach()
    n, k = weight.shape
    step = weight.reshape(n, -1, group_size).abs().amax(dim=2, keepdim=True) / 127
    reference = (torch.round(weight.reshape(n, -1, group_size) / step) * step).reshape(n, k)
    torch.testing.assert_close(quantized.dequantize(), reference, rtol=0, atol=1e-6)
    _check_matmul(quantized, reference, layer.bias.detach())


def test_int8_groups_keep_a_q8_0_grid_exactly():
    """Weights already on a Q8_0 grid (w = q * d per 32-block, d fp16, 127 reached in each
    block as llama.cpp's quantizer leaves it) come back exact: q and d themselves."""
    torch.manual_seed(4)
    n, k, block = 64, 96, 32
    q = torch.randint(-127, 128, (n, k // block, block)).float()
    q[..., 0] = 127 * torch.sign(torch.randn(n, k // block))
    d = (torch.rand(n, k // block, 1) * 0.01 + 1e-4).half().float()
    weight = (q * d).reshape(n, k)
    layer = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    quantized = _quantize("int8", layer, group_size=32)
    assert torch.equal(quantized.dequantize(), weight)
    assert torch.equal(quantized.qweight.float(), q.reshape(n, k)) and torch.equal(quantized.scale, d[..., 0])


def _int4_reference(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, per-element error bound (max - min) / 30 of its group)."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    q = torch.round((groups - low) / step).clamp(0, 15)
    bound = (step / 2).expand_as(groups)
    return (q * step + low).reshape(n, k), bound.reshape(n, k)


@pytest.mark.parametrize(
    "shape, config, group_size, uses_kernel",
    [
        ((128, 576), {}, 64, True),  # SmolLM2's 576 takes 64
        ((64, 256), {}, 128, True),
        ((192, 576), {"group_size": 32}, 32, True),
        ((37, 96), {}, 32, True),  # 37 rows: kvserve's kernel takes any row count
        ((45, 130), {"group_size": 10}, 10, False),
    ],
)
def test_int4_round_trip_and_matmul(shape, config, group_size, uses_kernel):
    layer = _linear(*shape, seed=2)
    quantized = _quantize("int4", layer, **config)
    assert quantized.group_size == group_size and (quantized.cpu_kernel is not None) == uses_kernel
    weight = layer.weight.detach()
    reference, bound = _int4_reference(weight, group_size)
    assert ((quantized.dequantize() - weight).abs() <= bound + 1e-6).all()
    torch.testing.assert_close(quantized.dequantize(), reference, rtol=0, atol=1e-5)
    _check_matmul(quantized, reference, layer.bias.detach())


def test_int4_takes_torchs_kernel_where_kvserves_is_not_built(monkeypatch):
    monkeypatch.setattr("kvserve.quantization.int4.int4_matmul_op", lambda: None)
    layer = _linear(128, 576, seed=3)
    quantized = _quantize("int4", layer, group_size=32)
    assert quantized.cpu_kernel == "torch"
    reference, _ = _int4_reference(layer.weight.detach(), 32)
    torch.testing.assert_close(quantized.dequantize(), reference, rtol=0, atol=1e-5)
    _check_matmul(quantized, reference, layer.bias.detach())


def test_int4_float_zero_points_keep_a_q4_1_grid_exactly():
    """Weights already on a Q4_1-style grid (w = q * d + m per 32-block) come back exact."""
    torch.manual_seed(3)
    n, k, block = 64, 96, 32
    q = torch.randint(0, 16, (n, k // block, block)).float()
    q[..., 0], q[..., 1] = 0, 15  # each block spans the whole grid, as Q4_1's do
    d = torch.rand(n, k // block, 1) * 0.01 + 1e-3
    m = -torch.rand(n, k // block, 1) * 0.1
    weight = (q * d + m).reshape(n, k)
    layer = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    quantized = _quantize("int4", layer, group_size=32)
    torch.testing.assert_close(quantized.dequantize(), weight, rtol=0, atol=1e-6)


def test_fits_fp16_accepts_only_values_fp16_keeps_to_its_precision():
    """Int4Linear.compact_scales' rule for storing scales and minimums in fp16 on CUDA."""
    assert fits_fp16(torch.tensor([0.0, 1e-3, -0.5, 6.0e4, 2.0**-14]))
    assert not fits_fp16(torch.tensor([1e-3, 1e-6]))  # 1e-6 is an fp16 subnormal: bits lost
    assert not fits_fp16(torch.tensor([7.0e4]))  # overflows to inf


def _nf4_reference(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest code value of w / absmax by brute force; error bound half the widest gap."""
    code = torch.tensor(BNB_NF4)
    flat = weight.flatten()
    pad = -flat.numel() % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, block)
    absmax = blocks.abs().amax(-1, keepdim=True)
    index = ((blocks / absmax)[..., None] - code).abs().argmin(-1)
    dequantized = (code[index] * absmax).flatten()[: flat.numel()].reshape(weight.shape)
    half_gap = (code.diff().max() / 2 * absmax).expand_as(blocks).flatten()[: flat.numel()]
    return dequantized, half_gap.reshape(weight.shape)


def test_nf4_code_book_is_bitsandbytes():
    from kvserve.quantization.nf4 import NF4_CODE

    assert torch.equal(NF4_CODE, torch.tensor(BNB_NF4))  # bitsandbytes stores fp32 too


@pytest.mark.parametrize("shape, block", [((37, 51), 64), ((128, 576), 64), ((33, 70), 32)])
def test_nf4_round_trip_and_matmul(shape, block):
    layer = _linear(*shape, seed=4)
    quantized = _quantize("nf4", layer, **({"block_size": block} if block != 64 else {}))
    weight = layer.weight.detach()
    reference, bound = _nf4_reference(weight, block)
    assert ((quantized.dequantize() - weight).abs() <= bound + 1e-6).all()
    torch.testing.assert_close(quantized.dequantize(), reference, rtol=0, atol=1e-6)
    assert quantized.weight_bytes() == -(-weight.numel() // 2) + 4 * -(-weight.numel() // block)
    _check_matmul(quantized, reference, layer.bias.detach())


def test_nf4_warns_once_that_it_has_no_kernel(caplog):
    """nf4 dequantizes every call: the load says so once, not once per layer."""
    from kvserve.quantization import quantize_model

    model = nn.Sequential(_linear(16, 32, seed=6), _linear(8, 16, seed=7))
    with caplog.at_level(logging.WARNING, logger="kvserve.quantization.nf4"):
        quantize_model(model, get_quantization_method("nf4"))
    warnings = [r for r in caplog.records if "has no kernel" in r.getMessage()]
    assert len(warnings) == 1 and "int4" in warnings[0].getMessage()


def test_few_rows_use_the_cpu_kernel_and_many_rows_the_dense_path(monkeypatch):
    quantized = _quantize("int8", _linear(64, 128, seed=5))
    calls: list[int] = []
    kernel = quantized.kernel_matmul
    monkeypatch.setattr(quantized, "kernel_matmul", lambda x: calls.append(x.shape[0]) or kernel(x))
    for rows in (1, CPU_KERNEL_MAX_ROWS, CPU_KERNEL_MAX_ROWS + 1, 200):
        quantized(torch.randn(rows, 128))
    assert calls == [1, CPU_KERNEL_MAX_ROWS]


def test_unknown_method_lists_supported():
    with pytest.raises(ValueError, match=r"unknown quantization 'int3'; supported: int8, int4, nf4"):
        get_quantization_method("int3")
    with pytest.raises(ValueError, match=r"unknown quantization_config keys \['bits'\]"):
        get_quantization_method("int4", {"bits": 3})
    with pytest.raises(ValueError, match="without a quantization method"):
        get_quantization_method(None, {"group_size": 32})


def test_group_size_that_does_not_divide_names_the_layer_at_load():
    with pytest.raises(ValueError, match=r"group_size 100 does not divide the input size 576 "
                       r"of layer 'model.layers.0.self_attn.qkv_proj'"):
        load_model(None, load_format="dummy", model_shape="smollm2-135m",
                   quantization="int4", quantization_config={"group_size": 100})
    with pytest.raises(ValueError, match=r"int8 group_size 100 does not divide the input size 576 "
                       r"of layer 'model.layers.0.self_attn.qkv_proj'"):
        load_model(None, load_format="dummy", model_shape="smollm2-135m",
                   quantization="int8", quantization_config={"group_size": 100})
    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        load_model(None, load_format="dummy", model_shape="smollm2-135m", quantization="fp4")


def test_dummy_weights_quantize_at_load(caplog):
    caplog.set_level(logging.INFO, logger="kvserve.model_executor.loader")
    method = "int8"  # int4 and nf4 load the real model in test_engine.py
    model = load_model(None, load_format="dummy", model_shape="smollm2-135m", quantization=method).model
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, QuantizedLinear)) and name != "quantized_lm_head"}
    assert len(linears) == 30 * 4 and all(isinstance(m, QuantizedLinear) for m in linears.values())
    assert isinstance(model.model.embed_tokens, nn.Embedding)  # the tied embedding stays fp32
    assert isinstance(model.quantized_lm_head, QuantizedLinear)  # int8 on CPU: a decode copy of the head
    assert f"quantization={method}: linear weights 424.7 MB -> " in caplog.text


def test_cli_flags():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--quantization", "int4", "--quantization-config", '{"group_size": 32}']
    ))
    assert args.quantization == "int4" and args.quantization_config == {"group_size": 32}
    for bad in (["--quantization", "int3"], ["--quantization-config", "[32]"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
