"""The LM head's decode copies: the int8 copy that int4, fp8 and int8 make by default (on CUDA,
and on CPU for fp32 heads), `quantization_config={"lm_head": "int8"}` or `"int4"` (or true:
the method's own format) and false (none); checked against the same grid in fp32/fp64 and
against the float head, which keeps the embedding lookups and larger inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_executor.dummy import dummy_model_config, init_dummy_weights
from kvserve.model_executor.loader import load_model
from kvserve.model_executor.models.llama import LlamaForCausalLM
from kvserve.quantization import quantize_model
from kvserve.quantization.base import CPU_KERNEL_MAX_ROWS
from kvserve.quantization.fp8 import Fp8Method
from kvserve.quantization.int4 import Int4Linear, Int4Method
from kvserve.quantization.int8 import GPU_HEAD_MAX_ROWS, Int8Linear, Int8Method


@pytest.fixture(scope="module")
def with_int4_head():
    return load_model(None, load_format="dummy", model_shape="smollm2-135m", dtype=torch.float32,
                      quantization="int4", quantization_config={"lm_head": True})


def test_int4_head_computes_on_its_grid_and_larger_inputs_on_the_float_head(with_int4_head):
    model = with_int4_head.model
    head = model.quantized_lm_head
    assert isinstance(head, Int4Linear) and head.group_size == 64  # 576 = 9 x 64
    embed = model.model.embed_tokens.weight  # SmolLM2 ties the head to the embedding
    torch.manual_seed(0)
    hidden = torch.randn(CPU_KERNEL_MAX_ROWS + 1, embed.shape[1])
    grid = head.dequantize(torch.float32)
    assert (grid - embed).abs().max() <= 0.5 * head.scale.max() + 1e-6  # half a step of a group
    for rows in (1, 5, CPU_KERNEL_MAX_ROWS):
        x = hidden[:rows].double()
        reference = F.linear(x, grid.double())
        # kvserve's CPU kernel rounds each row of x to int16 (half a step of |x|max / 32767).
        bound = x.abs().amax(dim=1, keepdim=True) / 32767 / 2 * grid.double().abs().sum(dim=1) + 1e-5
        assert ((model.compute_logits(hidden[:rows]).double() - reference).abs() <= bound).all(), rows
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, embed))
    assert head.dense_weight.tensor.data_ptr() == embed.data_ptr()  # the head itself, no copy


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_on_cpu_an_fp32_head_gets_an_int8_copy_by_default_and_a_bf16_one_none(method):
    fp32 = load_model(None, load_format="dummy", model_shape="smollm2-135m", dtype=torch.float32,
                      quantization=method)
    assert isinstance(fp32.model.quantized_lm_head, Int8Linear)
    bf16 = load_model(None, load_format="dummy", model_shape="smollm2-135m", dtype=torch.bfloat16,
                      quantization=method)
    assert bf16.model.quantized_lm_head is None
    plain = load_model(None, load_format="dummy", model_shape="smollm2-135m", dtype=torch.float32,
                       quantization=method, quantization_config={"lm_head": False})
    assert plain.model.quantized_lm_head is None


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_int8_head_option_computes_on_its_grid(method):
    loaded = load_model(None, load_format="dummy", model_shape="smollm2-135m", dtype=torch.float32,
                        quantization=method, quantization_config={"lm_head": "int8"})
    model = loaded.model
    head = model.quantized_lm_head
    assert isinstance(head, Int8Linear)
    embed = model.model.embed_tokens.weight
    grid = head.dequantize(torch.float64)
    assert ((grid - embed.double()).abs() <= head.scale.double()[:, None] * (0.5 + 1e-5)).all()  # half a step a row
    torch.manual_seed(0)
    hidden = torch.randn(CPU_KERNEL_MAX_ROWS + 1, embed.shape[1])
    for rows in (1, CPU_KERNEL_MAX_ROWS):
        logits = model.compute_logits(hidden[:rows]).double()
        reference = hidden[:rows].double() @ grid.T
        assert ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max() < 1e-5, rows
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, embed))


@pytest.mark.parametrize("method, value, supported", [
    ("int4", 1, r"\['int4', 'int8'\]"), ("int4", "nf4", r"\['int4', 'int8'\]"), ("fp8", "fp8", r"\['int8'\]"),
    ("int8", "yes", r"\['int8'\]"),
])
def test_lm_head_option_names_what_is_supported(method, value, supported):
    with pytest.raises(ValueError, match=rf"quantization='{method}': lm_head must be true, false or one of "
                                         rf"{supported}, got {value!r}"):
        load_model(None, load_format="dummy", model_shape="smollm2-135m", quantization=method,
                   quantization_config={"lm_head": value})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_int4_head_runs_the_triton_kernel_for_decode_rows():
    """llama3-8b's untied head shape on a 2-layer dummy: decode rows through the Triton int4
    kernel against the same grid in fp64, prefill-sized inputs on the bf16 head itself."""
    config = dataclasses.replace(dummy_model_config("llama3-8b", torch.bfloat16), num_hidden_layers=2)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    init_dummy_weights(model, seed=0)
    quantize_model(model, Int4Method({"lm_head": "int4"}))
    head = model.quantized_lm_head
    assert isinstance(head, Int4Linear) and head.group_size == 128 and head.qweight.is_cuda
    grid = head.dequantize(torch.float64)
    torch.manual_seed(0)
    hidden = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 16, 64):
        logits = model.compute_logits(hidden[:rows]).double()
        reference = hidden[:rows].double() @ grid.T
        error = ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()
        assert error < 1e-2, (rows, error)  # bf16 output rounding
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, model.lm_head.weight).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", [Int4Method, Fp8Method, Int8Method])
def test_gpu_int8_head_by_default_runs_the_triton_kernel_for_decode_rows(method):
    """Each weight-only method's default on CUDA: an int8 copy of llama3-8b's untied head for
    up to GPU_HEAD_MAX_ROWS rows (one row on the byte kernel of wide weights, more on tl.dot
    tiles), against the same grid in fp64; more rows on the bf16 head itself."""
    if method is Fp8Method and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need compute capability 8.9")
    config = dataclasses.replace(dummy_model_config("llama3-8b", torch.bfloat16), num_hidden_layers=2)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    init_dummy_weights(model, seed=0)
    quantize_model(model, method())
    head = model.quantized_lm_head
    assert isinstance(head, Int8Linear) and head.qweight.is_cuda
    grid = head.dequantize(torch.float64)
    torch.manual_seed(0)
    hidden = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 4, GPU_HEAD_MAX_ROWS):
        logits = model.compute_logits(hidden[:rows]).double()
        reference = hidden[:rows].double() @ grid.T
        error = ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()
        assert error < 1e-2, (rows, error)  # bf16 output rounding
    for rows in (GPU_HEAD_MAX_ROWS + 1, 200):
        assert torch.equal(model.compute_logits(hidden[:rows]), F.linear(hidden[:rows], model.lm_head.weight).float())
    assert head.dense_weight.tensor.data_ptr() == model.lm_head.weight.data_ptr()  # the head itself, no copy
