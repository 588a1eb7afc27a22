"""The one-row dense GEMV (kvserve/ops/dense_gemv.py) against the fp32 product of the same
operands: under the interpreter in CI (shapes whose rows and k are not multiples of the
tiles, with and without a bias), compiled for sm_90 (the weight tile loads before the wait,
x after it), and on the GPU inside a CUDA graph behind a kernel that writes its x. The same
for two GEMVs with the RMSNorm between them fused into them (PendingNorm): the first adds
its output to the residual stream and leaves the norm's sums, the second scales its output.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvserve.ops.triton_offline import compile_kernel

from tests.cuda_graphs import captured
from tests.triton_interpreter import run_interpreted

# (rows N, k K, (BLOCK_N, BLOCK_K[, splits of K]), bias, dtype): partial row blocks, k
# tails, one k tile; K split in 2 and 3 runs of tiles (a short last one), one tile a split
# (7 of them, 8 asked for), and a split asked of one tile (none made).
CASES = [(37, 200, (8, 64), False, torch.bfloat16), (40, 64, (8, 64), True, torch.float16),
         (12, 130, (4, 128), True, torch.bfloat16), (5, 48, (8, 64), False, torch.float16),
         (37, 200, (8, 64, 2), True, torch.bfloat16), (12, 130, (4, 32, 3), False, torch.float16),
         (37, 200, (8, 32, 8), False, torch.bfloat16), (40, 64, (8, 64, 2), True, torch.float16)]


def errors(device: str) -> list[str]:
    """Every case whose result is not the fp32 product rounded to the dtype, within one
    rounding (the kernel sums in another order than the reference)."""
    from kvserve.ops.dense_gemv import gemv

    wrong = []
    torch.manual_seed(0)
    for n, k, block, has_bias, dtype in CASES:
        x = torch.randn(1, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        bias = torch.randn(n, device=device).to(dtype) if has_bias else None
        expected = x.float() @ w.float().T + (bias.float() if has_bias else 0.0)
        first = gemv(x, w, bias, block=block)
        got = first.float()
        error = (got - expected).abs().max().item()
        tolerance = 2 * torch.finfo(dtype).eps * expected.abs().max().item()
        if got.shape != (1, n) or error > tolerance:
            wrong.append(f"{(n, k, block, has_bias, dtype)}: error {error:.3g} > {tolerance:.3g}")
        # The split sums' counters are re-armed: a second call finds them at 0, and adds
        # the splits in the same order.
        if not torch.equal(gemv(x, w, bias, block=block), first):
            wrong.append(f"{(n, k, block, has_bias, dtype)}: a second call differs")
    return wrong


def run_cases() -> None:
    print(json.dumps(errors("cpu")))


def test_interpreted_gemv_equals_the_fp32_product() -> None:
    assert json.loads(run_interpreted("tests.ops.test_dense_gemv", "run_cases")) == []


@pytest.mark.parametrize("split", [False, True])
def test_compiled_gemv_loads_weights_before_the_wait_and_x_after(split) -> None:
    """A programmatic dependent (kvserve.ops.pdl) as the GPU runs it: it lets the next kernel
    launch, then its first weight tile loads, then it waits; x (the previous kernel's
    output) and the bias load only after the wait. Split, the same from its split's k."""
    body = _compiled_body(HAS_BIAS=True, BLOCK_N=8, BLOCK_K=256, ROW_SCALE=False, PARTIALS=1, ADD_NORM=False,
                          SPLIT=split)
    launch, wait = body.index("griddepcontrol.launch_dependents"), body.index("griddepcontrol.wait")
    assert launch < wait
    # The weight tile: 8 rows x 256 bf16 over 128 threads, 16 bytes a load, with evict_first.
    before = re.findall(r"ld\.global[^\n]*", body[:wait])
    assert before and all("evict_first" in load for load in before), before
    assert re.search(r"ld\.global", body[wait:])


def _compiled(**constexprs: object):
    """The kernel compiled for sm_90 with PDL on."""
    from kvserve.ops.dense_gemv import _dense_gemv_kernel

    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "pending_ptr": "*fp32",
             "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16", "sum_squares_ptr": "*fp32", "partial_ptr": "*fp32",
             "count_ptr": "*i32", "norm_eps": "fp32"}
    return compile_kernel(_dense_gemv_kernel, {"SPLIT": False, **constexprs, "PDL": True}, types=types,
                          divisible=("K", "stride_w"))


def _compiled_body(**constexprs: object) -> str:
    """The PTX of the kernel's entry."""
    ptx = _compiled(**constexprs).asm["ptx"]
    return ptx[ptx.index(".entry"):]


# -- The RMSNorm between two GEMVs, fused into them ------------------------------------------

EPS = 1e-5
# Worst relative error per row against the fp32 chain: the run dtype's rounding of y1, h and
# the norm's output, a few ulps.
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
# (k K, hidden H, n N, the producer's and the consumer's (BLOCK_N, BLOCK_K), consumer bias,
# dtype): x [1, K] -> W1 [H, K] -> residual add + RMSNorm(H) -> W2 [N, H]. Row blocks and k
# tiles not dividing H, N and K; 5 and 33 partial sums (not powers of two) and one.
# Split K in each of the two GEMVs (3 splits, 2 of them the last short; 5 asked, 4 made).
CHAIN_CASES = [(200, 37, 53, (8, 64), (4, 64), False, torch.bfloat16),
               (200, 37, 53, (8, 64, 3), (4, 16, 2), True, torch.bfloat16),
               (130, 64, 19, (8, 32, 5), (4, 32, 2), False, torch.float16),
               (200, 37, 53, (8, 64), (4, 64), True, torch.float16),
               (96, 130, 45, (4, 128), (8, 64), True, torch.bfloat16),
               (130, 64, 19, (8, 256), (4, 32), False, torch.float16),
               (64, 8, 30, (8, 64), (8, 64), False, torch.bfloat16)]


def chain_errors(case: tuple, device: str) -> dict[str, float]:
    """The fused chain (gemv_add_norm, then gemv of the PendingNorm) against the fp32 torch
    chain of the unfused layers: y1 = x W1^T to the run dtype, h = residual + y1 in it,
    Hugging Face's RMSNorm (h.float() * rsqrt(mean(h^2) + eps), cast, times the weight),
    then W2 (+ b2). Relative errors of the residual updated in place, the finished norm, the
    consumer's output, and of the sums' total."""
    from kvserve.ops.dense_gemv import gemv, gemv_add_norm, tile
    from kvserve.ops.pending_norm import PendingNorm

    k, hidden, n, producer_block, consumer_block, has_bias, dtype = case
    producer_block = producer_block or tile(hidden, k, torch.device(device))
    generator = torch.Generator().manual_seed(k * hidden + n)

    def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    x, w1, w2 = random(1, k), random(hidden, k, scale=0.1), random(n, hidden)
    residual = random(1, hidden, scale=4)  # mean(h^2) far from 1: a missing factor shows
    norm_weight = (1 + torch.randn(hidden, generator=generator) * 0.1).to(dtype).to(device)
    bias = random(n) if has_bias else None

    y1 = (x.float() @ w1.float().T).to(dtype)
    h = (residual.float() + y1.float()).to(dtype)
    normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)).to(dtype) * norm_weight
    expected = normed.float() @ w2.float().T + (bias.float() if has_bias else 0.0)

    # The plain GEMV sums in the fused one's order: h from its y1 is the fused h bit for bit.
    h_same_order = residual + gemv(x, w1, block=producer_block)
    rows, sums = gemv_add_norm(x, w1, residual, norm_weight, block=producer_block)
    pending = PendingNorm(rows, sums, EPS)
    y2 = gemv(pending, w2, bias, block=consumer_block)
    assert y2.shape == (1, n) and y2.dtype == dtype and sums.shape == (1, -(-hidden // producer_block[0]))

    def relative(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want.float()).norm() / want.float().norm()).item()

    return {"residual": relative(residual, h), "residual_bits": float(not torch.equal(residual, h_same_order)),
            "norm": relative(pending.finish(), normed),
            "consumer": relative(y2, expected),
            "sums": abs(sums.double().sum().item() / h.double().pow(2).sum().item() - 1)}


def run_chain_cases() -> None:
    print(json.dumps([chain_errors(case, "cpu") for case in CHAIN_CASES]))


@pytest.fixture(scope="module")
def interpreted_chains() -> list[dict[str, float]]:
    return json.loads(run_interpreted("tests.ops.test_dense_gemv", "run_chain_cases"))


@pytest.mark.parametrize("index", range(len(CHAIN_CASES)), ids=[str(case) for case in CHAIN_CASES])
def test_interpreted_fused_norm_chain_matches_the_unfused_one(index, interpreted_chains) -> None:
    check_chain(interpreted_chains[index], CHAIN_CASES[index][-1])


def check_chain(errors: dict[str, float], dtype: torch.dtype) -> None:
    assert errors["residual_bits"] == 0 and errors["sums"] <= 1e-5, errors
    for output in ("residual", "norm", "consumer"):
        assert errors[output] <= TOLERANCE[dtype], (output, errors)


@pytest.mark.parametrize(("row_scale", "add_norm"), [(True, False), (False, True), (True, True)])
def test_compiled_fused_norm_gemvs_load_only_weights_before_the_wait(row_scale, add_norm) -> None:
    """The fused norm's operands are the previous kernels' outputs: the pending norm's sums
    and rows (the consumer), the residual stream (the producer) load after the wait; before
    it only the first weight tile (evict_first), as in the plain GEMV."""
    body = _compiled_body(HAS_BIAS=False, BLOCK_N=4, BLOCK_K=512, ROW_SCALE=row_scale,
                          PARTIALS=1024 if row_scale else 1, ADD_NORM=add_norm)
    launch, wait = body.index("griddepcontrol.launch_dependents"), body.index("griddepcontrol.wait")
    assert launch < wait
    before = re.findall(r"ld\.global[^\n]*", body[:wait])
    assert before and all("evict_first" in load for load in before), before
    after = re.findall(r"ld\.global[^\n]*", body[wait:])
    # The sums (8 fp32 a thread), x, the next weight tiles; with add_norm the residual and
    # the norm's weight (one bf16 each a thread).
    assert sum(".b32 " in load and "evict_first" not in load for load in after) >= (8 if row_scale else 0), after
    assert sum(".b16 " in load for load in after) == (2 if add_norm else 0), after


@pytest.mark.parametrize(("block_n", "block_k", "split"), [(8, 256, False), (4, 512, False), (8, 512, False),
                                                       (4, 512, True), (8, 256, True)])
def test_compiled_fused_norm_gemv_does_not_spill(block_n, block_k, split) -> None:
    """Both fused norms at once, with 2048 sums (an 8192-wide producer at 4 rows a program)
    held through the loop: still in registers at tile's sizes, K split or not."""
    from kvserve.ops.triton_offline import resource_usage

    compiled = _compiled(HAS_BIAS=True, BLOCK_N=block_n, BLOCK_K=block_k, ROW_SCALE=True, PARTIALS=2048,
                         ADD_NORM=True, SPLIT=split)
    assert resource_usage(compiled)[1] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_gemv_equals_the_fp32_product() -> None:
    assert errors("cuda") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("hidden", "out_features"), [(2048, 5120), (4096, 2048)])
def test_gpu_linear_takes_the_gemv_in_a_cuda_graph_after_the_kernel_writing_its_input(hidden, out_features) -> None:
    """As a decode step runs it: the add+RMSNorm kernel writes x, then the Linear's GEMV
    reads it, replayed in a CUDA graph with new inputs each time. A GEMV that read x before
    the norm finished would be off on some replays; 2048 x 4096 splits K (tile), whose
    counters must be back at 0 for each replay."""
    from kvserve.model_executor.layers.linear import Linear
    from kvserve.ops import dense_gemv
    from kvserve.ops.elementwise import add_rms_norm

    torch.manual_seed(0)
    dtype = torch.bfloat16
    assert (dense_gemv.tile(out_features, hidden, torch.device("cuda")).splits > 1) == (hidden > 2048)
    layer = Linear(hidden, out_features, bias=False, device="cuda", dtype=dtype)
    norm_weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    h = torch.randn(1, hidden, device="cuda", dtype=dtype)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)
    assert dense_gemv.applies(h, layer.weight)

    def step() -> torch.Tensor:
        return layer(add_rms_norm(h, norm_weight, 1e-6, residual))

    graph, out = captured(step)
    for _ in range(20):
        h.copy_(torch.randn_like(h))
        residual.copy_(torch.randn_like(residual))
        before = residual.clone()
        graph.replay()
        x = torch.nn.functional.rms_norm((before + h).float(), (hidden,), norm_weight.float(), 1e-6)
        expected = x.to(dtype).float() @ layer.weight.float().T
        torch.testing.assert_close(out.float(), expected, atol=3e-2 * expected.abs().max().item(), rtol=0)


# llama3-8b's pairs at one row (o_proj -> gate/up, down -> q/k/v) and Qwen3-30B-A3B's shapes
# (o_proj 2048 x 4096 -> q/k/v 5120 x 2048, with a bias as Qwen2's q/k/v have), at the
# launch's own tiles.
GPU_CHAIN_CASES = [(4096, 4096, 28672, None, None, False), (14336, 4096, 6144, None, None, False),
                   (4096, 2048, 5120, None, None, True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("case", GPU_CHAIN_CASES, ids=str)
def test_gpu_fused_norm_chain_matches_the_unfused_one(case, dtype) -> None:
    check_chain(chain_errors((*case, dtype), "cuda"), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_gpu_dense_pair_fuses_its_norm_in_a_cuda_graph(dtype) -> None:
    """Two dense linears with the norm between them left pending by the first's GEMV
    (Linear.add_norm_matmul) and finished by the second's, as a chain of dependent launches:
    a chained kernel (an RMSNorm) writes the first one's input; replayed in a CUDA graph
    with new inputs each time, against the fp32 chain and the unfused layers. A GEMV that
    read its input, the residual or the sums before the kernel before it finished would be
    off on some replays. (RMSNorm.add_after keeps the norm's own kernel between two dense
    GEMVs, measured faster; a mixture of experts stands on one side in the models.)"""
    from kvserve.model_executor.layers.layernorm import RMSNorm
    from kvserve.model_executor.layers.linear import Linear
    from kvserve.ops.elementwise import add_rms_norm
    from kvserve.ops.pending_norm import PendingNorm

    torch.manual_seed(0)
    hidden, intermediate = 4096, 2 * 14336
    o_proj = Linear(hidden, hidden, bias=False, device="cuda", dtype=dtype)
    gate_up = Linear(hidden, intermediate, bias=False, device="cuda", dtype=dtype)
    with torch.no_grad():
        o_proj.weight.mul_(4)  # h's mean square far from 1
    norm = RMSNorm(hidden, EPS).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, device="cuda"))
    attn_weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    attn = torch.randn(1, hidden, device="cuda", dtype=dtype)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)

    def step() -> torch.Tensor:
        x = add_rms_norm(attn, attn_weight, EPS)  # a chained kernel writing o_proj's input
        pending = o_proj.add_norm_matmul(x, residual, norm.weight, norm.eps)
        assert isinstance(pending, PendingNorm)
        return gate_up(pending)

    def reference(attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.nn.functional.rms_norm(attn.float(), (hidden,), attn_weight.float(), EPS).to(dtype)
        h = residual + (x.float() @ o_proj.weight.float().T).to(dtype)
        normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)).to(dtype) * norm.weight
        return h, normed.float() @ gate_up.weight.float().T

    graph, out = captured(step)
    for _ in range(20):
        attn.copy_(torch.randn_like(attn))
        residual.copy_(torch.randn_like(residual))
        before = residual.clone()
        graph.replay()
        h, expected = reference(attn, before)
        torch.testing.assert_close(residual.float(), h.float(), atol=2 * torch.finfo(dtype).eps * h.abs().max().item(),
                                   rtol=0)
        assert ((out.float() - expected).norm() / expected.norm()).item() <= TOLERANCE[dtype]
    # The unfused layers on the last inputs.
    residual.copy_(before)
    normed, _ = norm(o_proj(add_rms_norm(attn, attn_weight, EPS)), residual)
    unfused = gate_up(normed).float()
    assert ((out.float() - unfused).norm() / unfused.norm()).item() <= TOLERANCE[dtype]
