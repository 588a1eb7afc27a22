"""The one-launch MoE routing kernel against softmax -> top-k -> renormalise in fp32 torch
written here, for 8, 60 and 128 experts, top-k 1, 2 and 8, 1, 7 and 33 tokens, bf16 and fp32
logits, with and without renormalisation; Qwen2-MoE's shared-expert gate against
torch.sigmoid. On CPU under Triton's interpreter; on a GPU also under CUDA-graph replay.

Tie rule: exactly equal logits (frequent in bf16) go to the lower expert index, and each
token's choices come out by weight descending, equal weights by index ascending. The
reference gets it from a stable descending sort of the fp32 probabilities; the GPU test
also checks that torch.topk on CUDA, which the kernel replaces, picks the same sets."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from kvserve.ops.moe_routing import route, route_hidden
from kvserve.ops.split_k import split_counters
from tests.triton_interpreter import run_interpreted


def reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over the experts, the top_k by a stable descending sort (ties: lower index
    first), divided by their sum when renormalize."""
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, order)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return order, weights


def make_logits(tokens: int, experts: int, dtype: torch.dtype, ties: bool, generator: torch.Generator
                ) -> torch.Tensor:
    """Random logits; with ties, on a grid of halves in [-2, 2] (most top-k boundaries tie)."""
    logits = torch.randn(tokens, experts, generator=generator) * 2
    if ties:
        logits = (logits.clamp(-2, 2) * 2).round() / 2
    return logits.to(dtype)


# (tokens, experts, top_k, dtype, renormalize, ties)
ALL_CASES = [(t, e, k, dtype, renorm, ties)
             for t, (e, k), dtype, renorm in itertools.product(
                 (1, 7, 33), itertools.product((8, 60, 128), (1, 2, 8)), (torch.bfloat16, torch.float32),
                 (False, True))
             for ties in ((False, True) if dtype == torch.bfloat16 else (False,))]
bf16, fp32 = torch.bfloat16, torch.float32
# The default run's: every (experts, top_k) once, each with every token count once over the
# experts and over the top-k; bf16 and fp32, renormalised or not, ties with and without.
SMALL_CASES = [(1, 8, 1, bf16, True, False), (7, 8, 2, fp32, True, False), (33, 8, 8, bf16, False, True),
               (7, 60, 1, fp32, False, False), (33, 60, 2, bf16, True, True), (1, 60, 8, fp32, True, False),
               (33, 128, 1, bf16, False, True), (1, 128, 2, fp32, False, False), (7, 128, 8, bf16, True, True)]


def choice_errors(case: str, ids: torch.Tensor, weights: torch.Tensor, expected_ids: torch.Tensor,
                  expected_weights: torch.Tensor, atol: float) -> list[str]:
    """What differs of the kernel's choices from the reference's: the ids exactly, then the
    weights within rtol 2e-6 and `atol`."""
    if not torch.equal(ids.cpu().long(), expected_ids):
        return [f"{case}: ids {ids.cpu().tolist()} != {expected_ids.tolist()}"]
    if not torch.allclose(weights.cpu(), expected_weights, rtol=2e-6, atol=atol):
        return [f"{case}: weights off by {(weights.cpu() - expected_weights).abs().max().item():.2e}"]
    return []


def errors(device: str, cases: list[tuple]) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    wrong = []
    for tokens, experts, top_k, dtype, renormalize, ties in cases:
        case = f"T={tokens} E={experts} k={top_k} {dtype} renormalize={renormalize} ties={ties}"
        logits = make_logits(tokens, experts, dtype, ties and dtype != torch.float32, generator)
        shared = torch.randn(tokens, 1, generator=generator).to(dtype)
        expected_ids, expected_weights = reference(logits, top_k, renormalize)
        ids, weights, gate = route(logits.to(device), top_k, renormalize, shared.to(device))
        if ids.dtype != torch.int32 or weights.dtype != torch.float32 or gate.dtype != dtype:
            wrong.append(f"{case}: dtypes {ids.dtype} {weights.dtype} {gate.dtype}")
            continue
        wrong += choice_errors(case, ids, weights, expected_ids, expected_weights, atol=1e-7)
        # One rounding of sigmoid's fp32 value to the logits' dtype either way.
        tol = 1e-6 if dtype == torch.float32 else 2**-8
        if not torch.allclose(gate.cpu().float(), torch.sigmoid(shared.float()), rtol=tol, atol=0):
            wrong.append(f"{case}: shared gate off")
    return wrong


def hidden_errors(device: str, cases: list[tuple], hidden: int) -> list[str]:
    """route_hidden against the reference on the logits x @ W^T summed in fp32 and rounded to
    the dtype (what the router's linear leaves), the shared gate likewise."""
    generator = torch.Generator().manual_seed(1)
    wrong = []
    for tokens, experts, top_k, dtype, renormalize, _ in cases:
        case = f"T={tokens} E={experts} k={top_k} H={hidden} {dtype} renormalize={renormalize}"
        x = torch.randn(tokens, hidden, generator=generator).to(dtype)
        w = (torch.randn(experts, hidden, generator=generator) * 2 / hidden**0.5).to(dtype)
        shared_w = (torch.randn(1, hidden, generator=generator) / hidden**0.5).to(dtype)
        logits = (x.double() @ w.double().T).to(dtype)
        shared = (x.double() @ shared_w.double().T).to(dtype)
        expected_ids, expected_weights = reference(logits, top_k, renormalize)
        ids, weights, gate = route_hidden(x.to(device), w.to(device), top_k, renormalize, shared_w.to(device))
        # Half-precision logits: where the fp32 sum lies next to a rounding boundary, the
        # kernel's and the fp64 reference's can round one ulp apart, moving the weights by
        # about p_i x p_j x that ulp (seen on the H200: 1.3e-6 at hidden 4000).
        wrong += choice_errors(case, ids, weights, expected_ids, expected_weights,
                               atol=1e-7 if dtype == torch.float32 else 1e-4)
        if split_counters(ids.device).any():
            wrong.append(f"{case}: arrival counters not re-armed")
        tol = 1e-6 if dtype == torch.float32 else 2**-8
        if gate.dtype != dtype or not torch.allclose(gate.cpu().float(), torch.sigmoid(shared.float()), rtol=tol,
                                                     atol=0):
            wrong.append(f"{case}: shared gate off")
    return wrong


# route_hidden's: at most 8 tokens (FUSED_GATE_MAX_TOKENS).
HIDDEN_CASES = [(1, 8, 2, torch.float32, True, False), (3, 60, 8, torch.bfloat16, False, False),
                (2, 128, 8, torch.bfloat16, True, False), (1, 8, 1, torch.bfloat16, False, False)]


def run_small_cases() -> None:
    # hidden 2100: two tiles of 2048 a program, the second masked.
    print(json.dumps(errors("cpu", SMALL_CASES) + hidden_errors("cpu", HIDDEN_CASES, hidden=300)
                     + hidden_errors("cpu", [(2, 8, 2, bf16, True, False)], hidden=2100)))


def run_all_cases() -> None:
    print(json.dumps(errors("cpu", ALL_CASES)))


def test_interpreted_routing_equals_softmax_topk_renormalise() -> None:
    assert json.loads(run_interpreted("tests.ops.test_moe_routing", "run_small_cases")) == []


@pytest.mark.slow
def test_interpreted_routing_every_case() -> None:
    assert json.loads(run_interpreted("tests.ops.test_moe_routing", "run_all_cases")) == []


def test_reference_breaks_ties_by_lower_index() -> None:
    """The reference's tie rule itself, on hand-made logits."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    ids, weights = reference(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_routing_equals_softmax_topk_renormalise() -> None:
    assert errors("cuda", ALL_CASES + [(257, 256, 8, torch.float16, True, True)]) == []
    small = [c for c in ALL_CASES if c[0] <= 7] + [(8, 256, 8, torch.float16, True, False)]
    assert hidden_errors("cuda", small, hidden=2048) == []
    assert hidden_errors("cuda", small, hidden=4000) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_torch_topk_picks_the_same_sets_on_ties() -> None:
    """What the kernel replaces (softmax, torch.topk on CUDA) chooses the same experts,
    exactly equal logits included; only the order among equal weights may differ."""
    generator = torch.Generator().manual_seed(2)
    for tokens, experts, top_k in ((33, 60, 8), (257, 128, 8), (64, 8, 2)):
        logits = make_logits(tokens, experts, torch.bfloat16, True, generator).cuda()
        _, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        ids, _, _ = route(logits, top_k, True)
        assert torch.equal(chosen.sort(dim=-1).values.cpu(), ids.long().sort(dim=-1).values.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_routing_replays_in_a_cuda_graph() -> None:
    generator = torch.Generator().manual_seed(1)
    for tokens, experts, top_k, renormalize in ((1, 128, 8, True), (7, 60, 4, False), (33, 8, 2, True)):
        logits = torch.zeros(tokens, experts, dtype=torch.bfloat16, device="cuda")
        shared = torch.zeros(tokens, 1, dtype=torch.bfloat16, device="cuda")
        route(logits, top_k, renormalize, shared)  # compile first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids, weights, gate = route(logits, top_k, renormalize, shared)
        for ties in (False, True, False):
            logits.copy_(make_logits(tokens, experts, torch.bfloat16, ties, generator))
            shared.copy_(torch.randn(tokens, 1, generator=generator))
            graph.replay()
            expected_ids, expected_weights = reference(logits.cpu(), top_k, renormalize)
            assert torch.equal(ids.cpu().long(), expected_ids)
            torch.testing.assert_close(weights.cpu(), expected_weights, rtol=2e-6, atol=1e-7)
            torch.testing.assert_close(gate.cpu().float(), torch.sigmoid(shared.cpu().float()), rtol=2**-8, atol=0)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_router_matmul_and_routing_replay_in_a_cuda_graph() -> None:
    """route_hidden captured, replayed on new activations: the arrival counters re-arm."""
    generator = torch.Generator().manual_seed(3)
    for tokens, experts, top_k, hidden in ((1, 128, 8, 2048), (8, 60, 4, 1000), (3, 8, 2, 4096)):
        x = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        w = (torch.randn(experts, hidden, generator=generator) * 2 / hidden**0.5).cuda().bfloat16()
        shared_w = (torch.randn(1, hidden, generator=generator) / hidden**0.5).cuda().bfloat16()
        route_hidden(x, w, top_k, True, shared_w)  # compile first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids, weights, gate = route_hidden(x, w, top_k, True, shared_w)
        for _ in range(3):
            x.copy_(torch.randn(tokens, hidden, generator=generator))
            graph.replay()
            logits = (x.double() @ w.double().T).bfloat16().cpu()
            expected_ids, expected_weights = reference(logits, top_k, True)
            assert torch.equal(ids.cpu().long(), expected_ids)
            torch.testing.assert_close(weights.cpu(), expected_weights, rtol=2e-6, atol=1e-7)
            shared = (x.double() @ shared_w.double().T).bfloat16().cpu()
            torch.testing.assert_close(gate.cpu().float(), torch.sigmoid(shared.float()), rtol=2**-8, atol=0)
        assert not split_counters(x.device).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_routing_is_one_kernel() -> None:
    """The routing after the router's matmul, shared-expert gate included, is one launch."""
    from torch.profiler import ProfilerActivity, profile

    logits = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)
    shared = torch.randn(1, 1, device="cuda", dtype=torch.bfloat16)
    route(logits, 8, True, shared)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        route(logits, 8, True, shared)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    shared_gate = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    route_hidden(x, gate, 8, True, shared_gate)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        route_hidden(x, gate, 8, True, shared_gate)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shared", [0, 96])
@pytest.mark.parametrize("renormalize", [False, True])
def test_gpu_sparse_moe_layer_equals_its_cpu_run(shared: int, renormalize: bool) -> None:
    """A packed SparseMoE (Qwen2-MoE's shape with a shared expert, Qwen3's without) in fp32
    on CUDA, routed by the kernels, against the same layer on CPU, routed by torch."""
    from kvserve.model_executor.layers.moe import SparseMoE

    torch.manual_seed(0)
    layer = SparseMoE(64, 48, 60, 4, renormalize, shared_intermediate_size=shared)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, 64**-0.5)
    x = torch.randn(33, 64)
    with torch.no_grad():
        expected = layer(x)
        layer = layer.cuda()
        assert layer.pack_experts()
        got = layer(x.cuda()).cpu()
        # 5 tokens and 1: the router's matmul inside the routing kernel (route_hidden); the
        # one token's 4 pairs take the pair GEMVs, the others the grouped GEMMs.
        got_few = layer(x[:5].cuda()).cpu()
        got_one = layer(x[:1].cuda()).cpu()
    tol = 1e-4 * expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=tol, rtol=0)
    torch.testing.assert_close(got_few, expected[:5], atol=tol, rtol=0)
    torch.testing.assert_close(got_one, expected[:1], atol=tol, rtol=0)


@pytest.mark.parametrize(("experts", "top_k", "shared"), [(128, 8, False), (8, 2, False), (60, 4, True)],
                         ids=["qwen3", "mixtral", "qwen2-moe"])
def test_routing_kernels_compile_for_sm90(experts, top_k, shared) -> None:
    """What the interpreter cannot check: both kernels compile for sm_90 (Triton's GPU
    pipeline, as the device runs them) at bf16 routers, with the launch's constants, and
    nothing spills."""
    import triton

    from kvserve.ops import moe_routing
    from kvserve.ops.triton_offline import compile_kernel, resource_usage

    block_e, block_k = triton.next_power_of_2(experts), triton.next_power_of_2(top_k)
    common = dict(TOP_K=top_k, RENORMALIZE=True, HAS_SHARED=shared, BLOCK_E=block_e, BLOCK_K=block_k)
    route = compile_kernel(moe_routing._routing_kernel, common, num_warps=1 if block_e <= 256 else 4,
                           types={"logits_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32",
                                  "shared_logits_ptr": "*bf16", "shared_gate_ptr": "*bf16"}, divisible=())
    rows = max(1, min(16, block_e // 64))
    gate = _compiled_gate_kernel(common, rows, row_scale=False)
    for compiled in (route, gate):
        registers, stack = resource_usage(compiled)
        assert stack == 0, f"{registers} registers and {stack} bytes of stack (spilled)"
    # The last program of a token learns it from an acquire-release count, re-armed after.
    ptx = gate.asm["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx and "atom.global.gpu.relaxed.exch" in ptx
    # A programmatic dependent (kvserve.ops.pdl): the next kernel may launch first thing; the
    # first weight tile loads before the wait for the previous kernel, x (its output) and the
    # counter only after it.
    body = ptx[ptx.index(".entry"):]
    launch, wait = body.index("griddepcontrol.launch_dependents"), body.index("griddepcontrol.wait")
    assert launch < wait
    assert "ld.global" in body[:wait] and "atom" not in body[:wait]


def _compiled_gate_kernel(common: dict, rows: int, row_scale: bool, num_warps: int = 4):
    from kvserve.ops import moe_routing
    from kvserve.ops.triton_offline import compile_kernel

    constexprs = {**common, "ROWS": rows, "BLOCK_H": max(256, 2048 // rows), "PDL": True, "ROW_SCALE": row_scale,
                  "PARTIALS": 1024 if row_scale else 1}
    return compile_kernel(moe_routing._gate_and_route_kernel, constexprs, num_warps=num_warps,
                          types={"x_ptr": "*bf16", "w_ptr": "*bf16", "shared_w_ptr": "*bf16", "logits_ptr": "*bf16",
                                 "count_ptr": "*i32", "ids_ptr": "*i32", "weights_ptr": "*fp32",
                                 "shared_gate_ptr": "*bf16", "pending_ptr": "*fp32", "norm_eps": "fp32"},
                          divisible=("hidden", "stride_x", "stride_w"))


def test_routing_kernel_reads_a_pending_norm_after_the_wait() -> None:
    """Finishing the RMSNorm that o_proj left pending (PendingNorm) adds loads of its sums
    (the previous kernel's output) after the wait only: before it the same weight tile
    loads as without, and nothing spills (Qwen3-30B-A3B's router as route_hidden launches
    it, one warp a program; 1024 sums, a 4096-wide o_proj's at 4 rows a program)."""
    import re

    from kvserve.ops.triton_offline import resource_usage

    common = dict(TOP_K=8, RENORMALIZE=True, HAS_SHARED=False, BLOCK_E=128, BLOCK_K=8)
    loads = {}
    for row_scale in (False, True):
        compiled = _compiled_gate_kernel(common, rows=2, row_scale=row_scale, num_warps=1)
        assert resource_usage(compiled)[1] == 0
        body = compiled.asm["ptx"][compiled.asm["ptx"].index(".entry"):]
        wait = body.index("griddepcontrol.wait")
        # The loads' instructions (their registers differ between the two).
        loads[row_scale] = (re.findall(r"ld\.global[.\w]*", body[:wait]), len(re.findall(r"ld\.global", body[wait:])))
    assert loads[True][0] == loads[False][0] and loads[True][0]
    assert loads[True][1] > loads[False][1]
