"""A mixture of experts finishing the RMSNorm that o_proj left pending (PendingNorm): the
routing kernel with the router's logits (route_hidden) scales them by each row's norm
factor before the softmax and top-k, and the pair GEMV scales gate/up's products before
the SwiGLU; and leaving the next one pending: the combine (or the summed down GEMV) adds
the layer's output to the residual stream and keeps the norm's sums. Checked under the
interpreter against the same kernels on the finished norm's rows and against fp32 torch;
the layer's decision (SparseMoE.folds_pending_norm) by its conditions. The PTX checks (the sums load after the wait) are in test_moe_routing.py and
test_pdl_chain_compile.py."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.ops.pending_norm import PendingNorm
from tests.ops.test_fused_moe import quantized_experts, reference, routing, to_device
from tests.cuda_graphs import captured
from tests.triton_interpreter import run_interpreted

EPS = 1e-6


def pending_rows(tokens: int, hidden: int, dtype: torch.dtype, generator: torch.Generator
                 ) -> tuple[PendingNorm, torch.Tensor]:
    """A PendingNorm as a producer's epilogue leaves it (rows = h * the norm's weight in the
    dtype, fp32 sums of h^2 in 3 blocks) and the finished norm as Hugging Face's RMSNorm
    computes it; h's mean square far from 1, so a factor left out shows."""
    h = (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    squares = torch.nn.functional.pad(h.float().pow(2), (0, -hidden % 3))
    sums = squares.reshape(tokens, 3, -1).sum(-1)
    normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)).to(dtype) * weight
    return PendingNorm((h.float() * weight.float()).to(dtype), sums, EPS), normed


def routing_errors(device: str) -> list[str]:
    """route_hidden of a PendingNorm against route_hidden of the finished rows: the same
    experts chosen, weights within the run dtype's rounding of the logits."""
    from kvserve.ops.moe_routing import route_hidden

    generator = torch.Generator().manual_seed(0)
    wrong = []
    # (tokens, experts, top_k, hidden, dtype): Qwen3's 128 experts' top 8, a hidden width
    # that is not a multiple of the tile.
    for tokens, experts, top_k, hidden, dtype in [(1, 128, 8, 300, torch.float32), (3, 60, 4, 300, torch.bfloat16),
                                                 (1, 8, 2, 2100, torch.float16)]:
        pending, normed = pending_rows(tokens, hidden, dtype, generator)
        gate = (torch.randn(experts, hidden, generator=generator) * 2 / hidden**0.5).to(dtype)
        ids, weights, _ = route_hidden(PendingNorm(pending.rows.to(device), pending.sums.to(device), EPS),
                                       gate.to(device), top_k, True)
        expected_ids, expected_weights, _ = route_hidden(normed.to(device), gate.to(device), top_k, True)
        case = f"T={tokens} E={experts} k={top_k} H={hidden} {dtype}"
        if not torch.equal(ids.sort(-1).values, expected_ids.sort(-1).values):
            wrong.append(f"{case}: other experts chosen")
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        error = (weights.sort(-1).values - expected_weights.sort(-1).values).abs().max().item()
        if not error <= tol:
            wrong.append(f"{case}: weights off by {error:.2e}")
    return wrong


def experts_errors(device: str) -> list[str]:
    """experts_gemv of a PendingNorm (the gate/up GEMV finishing it) against the fp32 loop
    on the finished rows, dense and int4 experts."""
    from kvserve.ops.fused_moe_gemv import GemvTile, experts_gemv

    generator = torch.Generator().manual_seed(1)
    wrong = []
    for tokens, experts, top_k, dtype, fmt, hidden, intermediate in [
            (1, 8, 2, torch.float32, "dense", 80, 96), (2, 16, 4, torch.bfloat16, "dense", 80, 96),
            (1, 8, 2, torch.bfloat16, "int4-g32", 64, 128)]:
        chosen, weights = routing(tokens, experts, top_k, generator)
        pending, normed = pending_rows(tokens, hidden, dtype, generator)
        w13, dense13 = quantized_experts(
            torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5, fmt)
        w2, dense2 = quantized_experts(
            torch.randn(experts, hidden, intermediate, generator=generator) / intermediate**0.5, fmt)
        if fmt == "dense":
            dense13, dense2 = dense13.to(dtype), dense2.to(dtype)
        expected = reference(normed, chosen, weights, dense13, dense2)
        tile = GemvTile(16, 64, 4)  # masked column blocks, k in several tiles
        got = experts_gemv(PendingNorm(pending.rows.to(device), pending.sums.to(device), EPS), chosen.to(device),
                           weights.to(device), to_device(w13, device, dtype), to_device(w2, device, dtype),
                           tile, tile).float().cpu()
        error = (got - expected).abs().max().item() / expected.abs().max().item()
        if not error <= (1e-4 if dtype == torch.float32 else 3e-2):
            wrong.append(f"T={tokens} E={experts} k={top_k} {dtype} {fmt}: relative error {error:.2e}")
    return wrong


def add_norm_errors(device: str) -> list[str]:
    """experts_gemv_add_norm (the combine, or the summed down GEMV, adding the layer's output
    to the residual stream and leaving the next norm pending), from a plain or a pending x:
    the residual bit for bit the plain layer's output added in the dtype, the finished norm
    against Hugging Face's RMSNorm of that, the sums' total against sum(h^2)."""
    from kvserve.ops.fused_moe_gemv import GemvTile, experts_gemv, experts_gemv_add_norm

    generator = torch.Generator().manual_seed(3)
    wrong = []
    tile = GemvTile(16, 64, 4)
    for tokens, top_k, dtype, summed, pending_input in [(1, 2, torch.bfloat16, False, False),
                                                        (2, 4, torch.float16, False, True),
                                                        (1, 2, torch.bfloat16, True, True)]:
        experts, hidden, intermediate = 8, 80, 96
        chosen, weights = routing(tokens, experts, top_k, generator)
        pending, normed = pending_rows(tokens, hidden, dtype, generator)
        x = PendingNorm(pending.rows.to(device), pending.sums.to(device), EPS) if pending_input else normed.to(device)
        w13 = to_device(quantized_experts(torch.randn(experts, 2 * intermediate, hidden, generator=generator)
                                          / hidden**0.5, "dense")[0], device, dtype)
        w2 = to_device(quantized_experts(torch.randn(experts, hidden, intermediate, generator=generator)
                                         / intermediate**0.5, "dense")[0], device, dtype)
        residual = (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype).to(device)
        norm_weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype).to(device)
        args = (chosen.to(device), weights.to(device), w13, w2)
        h = residual + experts_gemv(x, *args, tile, tile, num_splits=3, summed_down=summed)
        rows, sums = experts_gemv_add_norm(x, *args, residual, norm_weight, tile, tile, num_splits=3,
                                           summed_down=summed)
        finished = PendingNorm(rows, sums, EPS).finish().float()
        expected = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)).to(dtype) * norm_weight
        case = f"T={tokens} k={top_k} {dtype} summed={summed} pending input={pending_input}"
        if not torch.equal(residual, h):
            wrong.append(f"{case}: residual stream off")
        error = ((finished - expected.float()).norm() / expected.float().norm()).item()
        total = sums.double().sum().item() / h.double().pow(2).sum().item() - 1
        if not (error <= 2e-2 and abs(total) <= 1e-5 and sums.shape == (tokens, -(-hidden // (16 if summed else 512)))):
            wrong.append(f"{case}: norm off by {error:.2e}, sums by {total:.2e}, {tuple(sums.shape)}")
    return wrong


def run_cases() -> None:
    print(json.dumps(routing_errors("cpu") + experts_errors("cpu") + add_norm_errors("cpu")))


def test_interpreted_moe_kernels_finish_and_leave_a_pending_norm() -> None:
    assert json.loads(run_interpreted("tests.ops.test_moe_fused_norm", "run_cases")) == []


def _packed_moe(shared: int = 0, dtype: torch.dtype = torch.bfloat16):
    from kvserve.model_executor.layers.moe import SparseMoE

    torch.manual_seed(0)
    layer = SparseMoE(64, 48, 16, 4, True, shared_intermediate_size=shared)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 64**-0.5)  # a Router starts empty()
    layer = layer.to(dtype)
    assert layer.pack_experts()
    return layer


def test_moe_folds_a_pending_norm_only_where_its_fused_kernels_run() -> None:
    """SparseMoE.folds_pending_norm: packed experts on CUDA (never here: the conditions
    besides the device checked apart), bf16/fp16 rows in the router's dtype, up to
    route_hidden's 8 tokens whose pairs take the pair GEMVs, no shared expert, one rank."""
    layer = _packed_moe()
    assert not layer.folds_pending_norm(1, torch.bfloat16)  # on CPU
    assert layer._fused_kernels_take(1, torch.bfloat16)
    # Dense experts take the pair GEMVs up to a quarter of the experts' pairs (uses_gemv):
    # here one token's 4; two tokens' 8 run the grouped GEMMs.
    assert not layer._fused_kernels_take(2, torch.bfloat16)
    assert not layer._fused_kernels_take(1, torch.float16)  # the router in bf16
    assert not layer._fused_kernels_take(1, torch.float32)
    layer.tp_group = object()
    assert not layer._fused_kernels_take(1, torch.bfloat16)
    assert not _packed_moe(shared=32)._fused_kernels_take(1, torch.bfloat16)


def test_moe_given_a_pending_norm_it_cannot_fold_finishes_it() -> None:
    layer = _packed_moe(dtype=torch.float32)
    pending, normed = pending_rows(2, 64, torch.float32, torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(layer(pending), layer(normed))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_moe_kernels_finish_and_leave_a_pending_norm() -> None:
    assert routing_errors("cuda") + experts_errors("cuda") + add_norm_errors("cuda") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_qwen3_moe_layer_runs_its_norms_in_a_cuda_graph(monkeypatch) -> None:
    """Qwen3-30B-A3B's shapes at one row: o_proj (dense, 4096 -> 2048) leaves the
    post-attention norm pending, the mixture (128 experts, top 8, 768 wide) finishes it and
    leaves the next layer's input norm pending, q/k/v (5120 x 2048) finishes that; replayed
    in a CUDA graph with new inputs, against the unfused layers (KVSERVE_FUSED_NORMS=0) on
    the same inputs: the residual stream and q/k/v within bf16 rounding."""
    from kvserve.model_executor.layers.layernorm import RMSNorm
    from kvserve.model_executor.layers.linear import Linear
    from kvserve.model_executor.layers.moe import SparseMoE

    torch.manual_seed(0)
    dtype, hidden = torch.bfloat16, 2048
    o_proj = Linear(4096, hidden, bias=False, device="cuda", dtype=dtype)
    qkv = Linear(hidden, 5120, bias=False, device="cuda", dtype=dtype)
    norms = [RMSNorm(hidden, EPS).to("cuda", dtype) for _ in range(2)]
    moe = SparseMoE(hidden, 768, 128, 8, True).to("cuda", dtype)
    with torch.no_grad():
        o_proj.weight.mul_(4)
        for norm in norms:
            norm.weight.copy_(1 + 0.1 * torch.randn(hidden, device="cuda"))
        moe.gate.weight.normal_(0, hidden**-0.5)
    assert moe.pack_experts() and moe.folds_pending_norm(1, dtype)
    attn = torch.randn(1, 4096, device="cuda", dtype=dtype)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)

    def step() -> torch.Tensor:
        x = attn * 1  # a kernel writing o_proj's input
        normed, _ = norms[0].add_after(o_proj, x, residual, moe)
        normed, _ = norms[1].add_after(moe, normed, residual, qkv)
        return qkv(normed)

    pending, _ = norms[0].add_after(o_proj, attn, residual.clone(), moe)
    assert isinstance(pending, PendingNorm)
    assert isinstance(norms[1].add_after(moe, pending, residual.clone(), qkv)[0], PendingNorm)
    graph, out = captured(step)
    for _ in range(10):
        attn.copy_(torch.randn_like(attn))
        residual.copy_(torch.randn_like(residual))
        before = residual.clone()
        graph.replay()
        fused_residual = residual.clone()
        with monkeypatch.context() as unfused:
            unfused.setenv("KVSERVE_FUSED_NORMS", "0")
            residual.copy_(before)
            expected = step().float()
        # The mixture's output from scaled logits and products: its roundings differ.
        assert ((fused_residual.float() - residual.float()).norm() / residual.float().norm()).item() <= 1e-2
        assert ((out.float() - expected).norm() / expected.norm()).item() <= 3e-2
