"""The LoRA shrink/expand kernels, per token (BGMV) and grouped by slot (SGMV), against a
per-token torch fp64 reference, on shapes that are not multiples of the blocks (ranks below
the padded rank, a slot that is empty, base tokens among adapter ones, slot runs that are
not whole tiles): under Triton's interpreter on CPU, at real sizes on a GPU (also replayed
in a CUDA graph with new slots), and a LoRA layer on CUDA against the same layer's CPU path."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.ops.lora import group_by_slot, lora_expand, lora_shrink, sgmv_expand, sgmv_shrink
from tests.triton_interpreter import run_interpreted


def case(device: str, num_tokens: int, in_features: int, slice_sizes: tuple[int, ...], num_slots: int, rank: int,
         dtype: torch.dtype, seed: int, form: str = "bgmv") -> float:
    """Largest error of the kernels' y against the reference, relative to the delta's size."""
    generator = torch.Generator().manual_seed(seed)
    num_slices = len(slice_sizes)
    x = torch.randn(num_tokens, in_features, generator=generator)
    lora_a = torch.randn(num_slots, num_slices * rank, in_features, generator=generator)
    lora_bs = [torch.randn(size, num_slots * rank, generator=generator) for size in slice_sizes]
    slots = torch.randint(-1, num_slots, (num_tokens + 3,), generator=generator, dtype=torch.int32)
    y = torch.randn(num_tokens, sum(slice_sizes), generator=generator)

    expected = y.double().clone()
    offsets = [0, *torch.tensor(slice_sizes).cumsum(0).tolist()]
    for t in range(num_tokens):
        s = int(slots[t])
        if s < 0:
            continue
        h = lora_a[s].double() @ x[t].double()
        for i in range(num_slices):
            b = lora_bs[i].view(-1, num_slots, rank)[:, s].double()
            expected[t, offsets[i]:offsets[i + 1]] += b @ h[i * rank:(i + 1) * rank]

    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    y_out = cast(y)
    if form == "bgmv":
        h = lora_shrink(cast(x), cast(lora_a), slots.to(device))
        for i in range(num_slices):
            lora_expand(h, i * rank, cast(lora_bs[i]), rank, slots.to(device), y_out, offsets[i])
    else:
        groups = group_by_slot(slots.to(device), num_tokens, num_slots)
        h = sgmv_shrink(cast(x), cast(lora_a), groups)
        for i in range(num_slices):
            sgmv_expand(h, i * rank, cast(lora_bs[i]), rank, num_slots, groups, y_out, offsets[i])
    scale = (expected - y.double()).abs().max().clamp_min(1.0)
    return float(((y_out.double().cpu() - expected).abs().max() / scale))


# The last: one token over 700 input columns, its shrink split 6 ways (split-K partials).
SMALL_CASES = [(5, 37, (13, 7, 7), 3, 5), (1, 130, (129,), 2, 16), (9, 64, (40, 40), 4, 3), (1, 700, (48,), 2, 16)]
# SGMV: more tokens than a tile, slots' runs cut across tiles; rank 5 pads to the dot's 16.
SMALL_SGMV_CASES = [(70, 37, (13, 7, 7), 3, 5), (7, 130, (129,), 2, 16), (33, 64, (40, 40), 4, 3)]


def run_small_cases() -> None:
    """Under the interpreter (a subprocess): prints each case's error as JSON."""
    print(json.dumps([case("cpu", *shape, torch.float32, seed) for seed, shape in enumerate(SMALL_CASES)]
                     + [case("cpu", *shape, torch.float32, seed, "sgmv") for seed, shape in enumerate(SMALL_SGMV_CASES)]))


def test_interpreted_kernels_equal_torch() -> None:
    errors = json.loads(run_interpreted("tests.ops.test_lora_kernels", "run_small_cases"))
    # fp32 rounding of sums over up to 130 products, in another order than the fp64 reference's.
    assert max(errors) < 1e-4, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("form", ["bgmv", "sgmv"])
def test_gpu_kernels_equal_torch(dtype, tolerance, form) -> None:
    for seed, shape in enumerate([*SMALL_CASES, *SMALL_SGMV_CASES, (300, 4096, (4096, 1024, 1024), 8, 16),
                                  (64, 14336, (4096,), 8, 16), (2048, 4096, (14336, 14336), 8, 16)]):
        assert case("cuda", *shape, dtype, seed, form) < tolerance, shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_lora_layer_equals_cpu_layer() -> None:
    from kvserve.lora.layers import LoRALinear
    from kvserve.model_executor.layers.linear import Linear

    torch.manual_seed(0)
    base = Linear(96, 80, bias=False)
    slots = [1, -1, 0, 2, 2, 1, -1]
    indices = torch.full((16,), -1, dtype=torch.int32)
    indices[: len(slots)] = torch.tensor(slots, dtype=torch.int32)
    cpu = LoRALinear(base, 96, (48, 32), 3, 8, indices.clone(), torch.float32)
    gpu = LoRALinear(Linear(96, 80, bias=False).cuda(), 96, (48, 32), 3, 8, indices.cuda(), torch.float32)
    gpu.base.weight.data.copy_(base.weight.data)
    for slot in range(3):
        slices = [(0, torch.randn(8 - slot, 96), torch.randn(48, 8 - slot)),
                  (1, torch.randn(3, 96), torch.randn(32, 3))]
        cpu.set_slot(slot, slices)
        gpu.set_slot(slot, [(i, a.cuda(), b.cuda()) for i, a, b in slices])
    x = torch.randn(len(slots), 96)
    assert torch.allclose(gpu(x.cuda()).cpu(), cpu(x), atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_grouped_kernels_replay_in_a_cuda_graph_with_new_slots() -> None:
    """The grouping and the SGMV kernels captured once, replayed after the slots buffer
    changes: each replay equals the per-token reference of its own slots."""
    generator = torch.Generator().manual_seed(0)
    num_tokens, in_features, out_features, num_slots, rank = 96, 256, 192, 4, 16
    x = torch.randn(num_tokens, in_features, generator=generator).cuda()
    lora_a = torch.randn(num_slots, rank, in_features, generator=generator).cuda()
    lora_b = torch.randn(out_features, num_slots * rank, generator=generator).cuda()
    slots = torch.full((num_tokens,), -1, dtype=torch.int32, device="cuda")
    y = torch.zeros(num_tokens, out_features, device="cuda")

    def forward() -> None:
        y.zero_()
        groups = group_by_slot(slots, num_tokens, num_slots)
        sgmv_expand(sgmv_shrink(x, lora_a, groups), 0, lora_b, rank, num_slots, groups, y, 0)

    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for seed in range(3):
        slots.copy_(torch.randint(-1, num_slots, (num_tokens,), generator=torch.Generator().manual_seed(seed),
                                  dtype=torch.int32))
        graph.replay()
        expected = torch.zeros(num_tokens, out_features, dtype=torch.float64)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                expected[t] = lora_b.view(out_features, num_slots, rank)[:, s].double().cpu() @ (
                    lora_a[s].double().cpu() @ x[t].double().cpu())
        torch.testing.assert_close(y.double().cpu(), expected, rtol=1e-4, atol=1e-3)


def test_kernels_compile_for_sm90() -> None:
    """The split-K per-token shrink, its expand and the grouped (SGMV) kernels compile for
    sm_90 at bf16 (what the interpreter cannot check), without spilling."""
    from kvserve.ops import lora
    from kvserve.ops.triton_offline import compile_kernel, resource_usage

    bf16 = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "h_ptr": "*fp32",
            "slots_ptr": "*i32", "sorted_ptr": "*i64", "block_slots_ptr": "*i64"}
    kernels = [
        (lora._shrink_kernel, dict(BLOCK_N=lora.SHRINK_BLOCK_N, BLOCK_K=lora.SHRINK_BLOCK_K)),
        (lora._expand_kernel, dict(BLOCK_OUT=lora.EXPAND_BLOCK_OUT, BLOCK_R=16)),
        (lora._sgmv_shrink_kernel, dict(BLOCK_M=lora.SGMV_BLOCK_M, BLOCK_N=lora.SGMV_SHRINK_BLOCK_N,
                                        BLOCK_K=lora.SGMV_SHRINK_BLOCK_K, DOT_PRECISION="tf32")),
        (lora._sgmv_expand_kernel, dict(BLOCK_M=lora.SGMV_BLOCK_M, BLOCK_OUT=lora.SGMV_EXPAND_BLOCK_OUT, BLOCK_R=16,
                                        DOT_PRECISION="tf32")),
    ]
    for kernel, constexprs in kernels:
        registers, stack = resource_usage(compile_kernel(kernel, constexprs, types=bf16, divisible=()))
        assert stack == 0, f"{kernel.fn.__name__}: {registers} registers and {stack} bytes of stack (spilled)"
