"""Batch-invariant quantized CPU layers: decode rows take the quantized kernel at any row
count (bit for bit their one-row result), prompt rows the dense copy, each run as the step
names it; against fp64 products of the dequantized weights and of the bf16 dense copy."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvserve.engine.engine_args import EngineArgs
from kvserve.entrypoints.openai.cli_args import add_cli_args as add_serve_args
from kvserve.ops.cpu import int4_matmul_op, int8_matmul_op
from kvserve.quantization.batch_invariance import RowRun, make_batch_invariant, routed_rows, row_runs
from kvserve.quantization.int4 import Int4Linear, quantize_int4
from kvserve.quantization.int8 import Int8Linear

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def int4_layer() -> Int4Linear:
    if int4_matmul_op() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    torch.manual_seed(0)
    layer = Int4Linear(*quantize_int4(torch.randn(192, 576), 32), 32, None)
    # The auto plan on an AMX CPU: a bf16 dense copy for inputs of more than 4 rows.
    layer.keep_dense_weight(None, torch.bfloat16, kernel_max_rows=4)
    return layer


def test_runs_merge_decodes_and_keep_each_prompt_apart():
    assert row_runs([(1, True), (1, True), (0, False), (5, False), (7, False), (1, True), (2, True)]) == (
        RowRun(0, 2, True), RowRun(2, 7, False), RowRun(7, 14, False), RowRun(14, 17, True))
    assert row_runs([]) == ()


def test_decode_rows_take_the_kernel_and_prompt_rows_the_dense_copy(int4_layer):
    torch.manual_seed(1)
    x = torch.randn(12, 576)
    exact = x.double() @ int4_layer.dequantize().double().T
    # The bf16 copy: bf16 inputs and weights, fp32 sums, a bf16 result.
    bf16 = (x.bfloat16().double() @ int4_layer.dense_weight.plain().double().T).float().bfloat16().double()
    # Per batch size (not invariant): 12 rows > 4, so every row on the bf16 copy.
    torch.testing.assert_close(int4_layer(x).double(), bf16, rtol=8e-3, atol=1e-3)
    try:
        make_batch_invariant(int4_layer)
        one_row = torch.cat([int4_layer(x[i : i + 1]) for i in range(12)])
        # The int4 kernel: activations rounded to int16 per row (~1e-5 relative), no bf16 rounding.
        torch.testing.assert_close(one_row.double(), exact, rtol=0, atol=2e-2)
        # Decode steps of any size: every row is its one-row result.
        assert torch.equal(int4_layer(x), one_row)
        runs = (RowRun(0, 3, True), RowRun(3, 10, False), RowRun(10, 12, True))
        with routed_rows(runs):
            y = int4_layer(x)
        assert torch.equal(y[:3], one_row[:3]) and torch.equal(y[10:], one_row[10:])
        # The prompt's rows: the bf16 copy, in a call of their own.
        torch.testing.assert_close(y[3:10].double(), bf16[3:10], rtol=8e-3, atol=1e-3)
        assert torch.equal(y[3:10], int4_layer.dense_weight.linear(x[3:10]))
        assert not torch.allclose(y[3:10], one_row[3:10], rtol=1e-4, atol=1e-4)
        with routed_rows(runs):  # an input of another size (the LM head's rows) is not routed
            assert torch.equal(int4_layer(x[:5]), one_row[:5])
    finally:
        int4_layer.batch_invariant = False


def test_the_int8_lm_head_copy_gives_each_row_its_one_row_result_at_any_batch():
    if int8_matmul_op() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    torch.manual_seed(2)
    head = torch.nn.Linear(576, 4096, bias=False)
    layer = Int8Linear(head)
    layer.keep_dense_weight(head.weight, torch.bfloat16, kernel_max_rows=4)
    make_batch_invariant(layer)
    x = torch.randn(33, 576)
    one_row = torch.cat([layer(x[i : i + 1]) for i in range(33)])
    torch.testing.assert_close(one_row.double(), x.double() @ layer.dequantize().double().T, rtol=1e-4, atol=1e-3)
    for rows in (5, 16, 17, 32, 33):
        assert torch.equal(layer(x[:rows]), one_row[:rows]), rows


def test_serve_turns_it_on_for_the_cpu_auto_plan_only():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    serve = EngineArgs.from_cli_args(parser.parse_args([]))
    assert serve.batch_invariant is None and serve.resolved_batch_invariant(CPU)
    assert not serve.resolved_batch_invariant(torch.device("cuda"))
    assert not EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int4"])).resolved_batch_invariant(CPU)
    assert not EngineArgs.from_cli_args(parser.parse_args(["--no-batch-invariant"])).resolved_batch_invariant(CPU)
    assert EngineArgs(quantization="int8", batch_invariant=True).resolved_batch_invariant(CPU)
    assert not EngineArgs(quantization="auto").resolved_batch_invariant(CPU)  # offline default: off
