"""The one-row dense GEMV (kvserve/ops/dense_gemv.py) against the fp32 product of the same
operands: under the interpreter in CI (shapes whose rows and k are not multiples of the
tiles, with and without a bias), compiled for sm_90 (the weight tile loads before the wait,
x after it), and on the GPU inside a CUDA graph behind a kernel that writes its x."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.triton_interpreter import run_interpreted

# (rows N, k K, BLOCK_N, BLOCK_K, bias, dtype): partial row blocks, k tails, one k tile.
CASES = [(37, 200, 8, 64, False, torch.bfloat16), (40, 64, 8, 64, True, torch.float16),
         (12, 130, 4, 128, True, torch.bfloat16), (5, 48, 8, 64, False, torch.float16)]


def errors(device: str) -> list[str]:
    """Every case whose result is not the fp32 product rounded to the dtype, within one
    rounding (the kernel sums in another order than the reference)."""
    from kvserve.ops.dense_gemv import gemv

    wrong = []
    torch.manual_seed(0)
    for n, k, block_n, block_k, has_bias, dtype in CASES:
        x = torch.randn(1, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        bias = torch.randn(n, device=device).to(dtype) if has_bias else None
        expected = x.float() @ w.float().T + (bias.float() if has_bias else 0.0)
        got = gemv(x, w, bias, block=(block_n, block_k)).float()
        error = (got - expected).abs().max().item()
        tolerance = 2 * torch.finfo(dtype).eps * expected.abs().max().item()
        if got.shape != (1, n) or error > tolerance:
            wrong.append(f"{(n, k, block_n, block_k, has_bias, dtype)}: error {error:.3g} > {tolerance:.3g}")
    return wrong


def run_cases() -> None:
    print(json.dumps(errors("cpu")))


def test_interpreted_gemv_equals_the_fp32_product() -> None:
    assert json.loads(run_interpreted("tests.ops.test_dense_gemv", "run_cases")) == []


def test_compiled_gemv_loads_weights_before_the_wait_and_x_after() -> None:
    """A programmatic dependent (kvserve.ops.pdl) as the GPU runs it: it lets the next kernel
    launch, then its first weight tile loads, then it waits; x (the previous kernel's
    output) and the bias load only after the wait."""
    from kvserve.ops.dense_gemv import _dense_gemv_kernel
    from kvserve.ops.triton_offline import compile_kernel

    ptx = compile_kernel(_dense_gemv_kernel, dict(HAS_BIAS=True, BLOCK_N=8, BLOCK_K=256, PDL=True),
                         types={"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
                         divisible=("K", "stride_w")).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    launch, wait = body.index("griddepcontrol.launch_dependents"), body.index("griddepcontrol.wait")
    assert launch < wait
    # The weight tile: 8 rows x 256 bf16 over 128 threads, 16 bytes a load, with evict_first.
    before = re.findall(r"ld\.global[^\n]*", body[:wait])
    assert before and all("evict_first" in load for load in before), before
    assert re.search(r"ld\.global", body[wait:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_gemv_equals_the_fp32_product() -> None:
    assert errors("cuda") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_linear_takes_the_gemv_in_a_cuda_graph_after_the_kernel_writing_its_input() -> None:
    """As a decode step runs it: the add+RMSNorm kernel writes x, then the Linear's GEMV
    reads it, replayed in a CUDA graph with new inputs each time. A GEMV that read x before
    the norm finished would be off on some replays."""
    from kvserve.model_executor.layers.linear import Linear
    from kvserve.ops import dense_gemv
    from kvserve.ops.elementwise import add_rms_norm

    torch.manual_seed(0)
    dtype = torch.bfloat16
    hidden, out_features = 2048, 5120
    layer = Linear(hidden, out_features, bias=False, device="cuda", dtype=dtype)
    norm_weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    h = torch.randn(1, hidden, device="cuda", dtype=dtype)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)
    assert dense_gemv.applies(h, layer.weight)

    def step() -> torch.Tensor:
        return layer(add_rms_norm(h, norm_weight, 1e-6, residual))

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(20):
        h.copy_(torch.randn_like(h))
        residual.copy_(torch.randn_like(residual))
        before = residual.clone()
        graph.replay()
        x = torch.nn.functional.rms_norm((before + h).float(), (hidden,), norm_weight.float(), 1e-6)
        expected = x.to(dtype).float() @ layer.weight.float().T
        torch.testing.assert_close(out.float(), expected, atol=3e-2 * expected.abs().max().item(), rtol=0)
