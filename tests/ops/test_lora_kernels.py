"""The LoRA shrink/expand kernels (per token, and grouped by slot) against per-token torch
references, on shapes that are not multiples of the blocks (ranks below the padded rank, a
slot that is empty, base tokens among adapter ones): under Triton's interpreter on CPU, at
real sizes on a GPU, a LoRA layer on CUDA against the same layer's CPU path, and LoRA layers
in a CUDA graph replayed with other slots."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.ops.lora import lora_expand_slices, lora_shrink
from tests.triton_interpreter import run_interpreted


def case(device: str, num_tokens: int, in_features: int, slice_sizes: tuple[int, ...], num_slots: int, rank: int,
         dtype: torch.dtype, seed: int, fused: bool = False, num_splits: int | None = None) -> float:
    """Largest error of the kernels' y against the reference, relative to the delta's size;
    `fused`: every slice expanded by one launch; `num_splits`: of the shrink's k."""
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
    h = lora_shrink(cast(x), cast(lora_a), slots.to(device), num_splits)
    if num_splits is not None:
        assert h.shape[0] == num_splits
    if fused:
        lora_expand_slices(h, [cast(b) for b in lora_bs], rank, slots.to(device), y_out)
    for i in range(0 if fused else num_slices):
        lora_expand_slices(h, [cast(lora_bs[i])], rank, slots.to(device), y_out, i * rank, offsets[i])
    scale = (expected - y.double()).abs().max().clamp_min(1.0)
    return float(((y_out.double().cpu() - expected).abs().max() / scale))


SMALL_CASES = [(5, 37, (13, 7, 7), 3, 5), (1, 130, (129,), 2, 16), (9, 64, (40, 40), 4, 3)]


def run_small_cases() -> None:
    """Under the interpreter (a subprocess): prints each case's error as JSON, every slice
    expanded by its own launch and by one; and k split in three (128-wide blocks: 256, 256
    and 88 of 600)."""
    errors = [case("cpu", *shape, torch.float32, seed, fused) for seed, shape in enumerate(SMALL_CASES)
              for fused in (False, True)]
    errors.append(case("cpu", 7, 600, (24, 9), 3, 8, torch.float32, 5, True, 3))
    print(json.dumps(errors))


def test_interpreted_kernels_equal_torch() -> None:
    errors = json.loads(run_interpreted("tests.ops.test_lora_kernels", "run_small_cases"))
    # The split case sums 600 unscaled products a row: fp32 rounding of ~4e-5 of the delta,
    # as much unsplit.
    assert max(errors[:-1]) < 1e-5 and errors[-1] < 1e-4, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_gpu_kernels_equal_torch(dtype, tolerance) -> None:
    for seed, shape in enumerate([*SMALL_CASES, (300, 4096, (4096, 1024, 1024), 8, 16), (64, 14336, (4096,), 8, 16)]):
        for fused in (False, True):
            assert case("cuda", *shape, dtype, seed, fused) < tolerance, (shape, fused)


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


# ---- the grouped (SGMV) kernels and the layer's choice between them and the per-token ones ----

def sgmv_case(device: str, num_tokens: int, in_features: int, slice_sizes: tuple[int, ...], num_slots: int,
              rank: int, dtype: torch.dtype, seed: int, num_splits: int | None = None) -> float:
    """Largest error of y after the grouped shrink (k split `num_splits` ways, if given) and
    one fused expand of every slice, against a per-token fp32 torch reference
    (x @ A[slot]^T @ B[slot]^T added to the rows of adapter tokens, base rows exactly
    unchanged), relative to the delta's size."""
    from kvserve.ops.lora import align_by_slot, sgmv_expand, sgmv_shrink

    generator = torch.Generator().manual_seed(seed)
    num_slices = len(slice_sizes)
    # The inputs as the kernels see them (rounded to dtype), in fp32 for the reference.
    rounded = lambda t: t.to(dtype).float()  # noqa: E731
    x = rounded(torch.randn(num_tokens, in_features, generator=generator))
    lora_a = rounded(torch.randn(num_slots, num_slices * rank, in_features, generator=generator) / in_features**0.5)
    lora_bs = [rounded(torch.randn(size, num_slots * rank, generator=generator)) for size in slice_sizes]
    # Slots mixed with base tokens, in no order; stale entries past num_tokens must be ignored.
    slots = torch.randint(-1, num_slots, (num_tokens + 5,), generator=generator, dtype=torch.int32)
    slots[num_tokens:] = 0
    y = rounded(torch.randn(num_tokens, 3 + sum(slice_sizes), generator=generator))
    y_offset = 3

    expected = y.clone()
    offsets = [y_offset, *(y_offset + torch.tensor(slice_sizes).cumsum(0)).tolist()]
    for t in range(num_tokens):
        s = int(slots[t])
        if s < 0:
            continue
        h = lora_a[s] @ x[t]
        for i in range(num_slices):
            b = lora_bs[i].view(-1, num_slots, rank)[:, s]
            expected[t, offsets[i]:offsets[i + 1]] += b @ h[i * rank:(i + 1) * rank]

    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    y_out = cast(y)
    device_slots = slots.to(device)
    groups = align_by_slot(device_slots, num_tokens, num_slots)
    h = sgmv_shrink(cast(x), cast(lora_a), groups, num_splits)
    if num_splits is not None:
        assert h.shape[0] == num_splits
    sgmv_expand(h, [cast(b) for b in lora_bs], rank, groups, y_out, 0, y_offset)
    result = y_out.float().cpu()
    base = slots[:num_tokens] < 0
    assert torch.equal(result[base], y.to(dtype).float()[base]), "base rows changed"
    assert torch.equal(result[:, :y_offset], y[:, :y_offset]), "columns before the slices changed"
    scale = (expected - y).abs().max().clamp_min(1.0)
    return float((result - expected).abs().max() / scale)


# (tokens, in, slice sizes, slots, rank[, k splits]): token counts 1, 7, 33, 130, odd feature
# sizes; k split in three (64-wide blocks: 128, 128 and 44 of 300).
SGMV_CASES = [(1, 37, (13, 7, 7), 3, 8), (7, 70, (40, 24), 4, 16), (33, 37, (45,), 2, 8),
              (130, 53, (13, 7, 7), 4, 16), (33, 300, (21, 11), 3, 16, 3)]


def layer_case(device: str, num_tokens: int, cached: bool, seed: int, sgmv_min_tokens: int = 64) -> float:
    """A q/k/v LoRA layer's kernel path (grouped from `sgmv_min_tokens` tokens, per token
    below) against an fp32 torch reference; `cached`: the grouping shared as in a model's
    forward pass."""
    from kvserve.lora.layers import LoRALinear, SlotGroupsCache

    torch.manual_seed(seed)
    in_features, sizes, num_slots, rank = 45, (24, 8, 8), 3, 8
    slots = torch.full((num_tokens + 4,), 2, dtype=torch.int32)
    slots[:num_tokens] = torch.randint(-1, num_slots, (num_tokens,), dtype=torch.int32)
    cache = SlotGroupsCache()
    base = torch.nn.Linear(in_features, sum(sizes), bias=False).to(device)
    layer = LoRALinear(base, in_features, sizes, num_slots, rank, slots.to(device), torch.float32, cache)
    layer.sgmv_min_tokens = sgmv_min_tokens
    if layer.transposed:  # on CPU tensors (the interpreter): B stored as on CUDA, [out, slots x rank]
        layer.transposed = False
        for i, size in enumerate(sizes):
            setattr(layer, f"lora_b_{i}", torch.zeros(size, num_slots * rank))
    adapters = []
    for slot in range(num_slots):
        slices = [(i, torch.randn(rank - slot, in_features), torch.randn(size, rank - slot))
                  for i, size in enumerate(sizes) if i != slot]  # each adapter skips one slice
        layer.set_slot(slot, [(i, a.to(device), b.to(device)) for i, a, b in slices])
        adapters.append(slices)
    x = torch.randn(num_tokens, in_features)
    expected = x @ base.weight.detach().cpu().t()
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    for t in range(num_tokens):
        s = int(slots[t])
        for i, a, b in adapters[s] if s >= 0 else []:
            expected[t, offsets[i]:offsets[i + 1]] += b @ (a @ x[t])
    with torch.no_grad():
        if cached:
            cache.begin()
        y = layer._forward_kernels(x.to(device), base(x.to(device)))
        if cached:  # a second layer's call reuses the grouping
            assert len(cache.groups) == (1 if num_tokens >= sgmv_min_tokens else 0)
            y = layer._forward_kernels(x.to(device), base(x.to(device)))
            cache.end()
    return float((y.cpu() - expected).abs().max() / (expected.abs().max()))


def run_sgmv_cases() -> None:
    """Under the interpreter (one subprocess for both cases' kinds): the grouped kernels in
    fp32 and the layer with few and many tokens; errors as JSON."""
    kernels = [sgmv_case("cpu", *shape[:5], torch.float32, seed, *shape[5:]) for seed, shape in enumerate(SGMV_CASES)]
    layers = [layer_case("cpu", num_tokens, cached, seed, *min_tokens)
              for seed, (num_tokens, cached, *min_tokens) in enumerate([(7, False), (70, True), (7, True, 1)])]
    print(json.dumps({"kernels": kernels, "layers": layers}))


def run_sgmv_cases_bf16() -> None:
    print(json.dumps([sgmv_case("cpu", *shape[:5], torch.bfloat16, seed, *shape[5:])
                      for seed, shape in enumerate(SGMV_CASES)]))


def test_interpreted_sgmv_kernels_and_layer_equal_torch() -> None:
    errors = json.loads(run_interpreted("tests.ops.test_lora_kernels", "run_sgmv_cases"))
    assert max(errors["kernels"]) < 1e-5, errors
    assert max(errors["layers"]) < 1e-5, errors


@pytest.mark.slow  # ~3 s more of the interpreter
def test_interpreted_sgmv_kernels_equal_torch_in_bf16() -> None:
    errors = json.loads(run_interpreted("tests.ops.test_lora_kernels", "run_sgmv_cases_bf16"))
    assert max(errors) < 2e-2, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_gpu_sgmv_kernels_equal_torch(dtype, tolerance) -> None:
    shapes = [*SGMV_CASES, (300, 4096, (4096, 1024, 1024), 8, 16), (2100, 14336, (4096,), 8, 16),
              (700, 4096, (14336, 14336), 8, 16), (64, 14336, (4096,), 8, 16)]
    for seed, shape in enumerate(shapes):
        assert sgmv_case("cuda", *shape[:5], dtype, seed, *shape[5:]) < tolerance, shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [8, 256])
def test_gpu_lora_layer_graph_replays_changed_slots(num_tokens) -> None:
    """Two q/k/v layers sharing one grouping, captured in a CUDA graph (per-token kernels for
    8 tokens, grouped for 256), replayed after the slots and inputs changed in place, against
    an fp32 torch reference."""
    from kvserve.lora.layers import LoRALinear, SlotGroupsCache

    torch.manual_seed(0)
    in_features, sizes, num_slots, rank = 256, (256, 64, 64), 4, 16
    slots = torch.full((512,), -1, dtype=torch.int32, device="cuda")
    cache = SlotGroupsCache()
    layers, adapters = [], []
    for _ in range(2):
        base = torch.nn.Linear(in_features, sum(sizes), bias=False).cuda()
        layer = LoRALinear(base, in_features, sizes, num_slots, rank, slots, torch.float32, cache)
        per_slot = []
        for slot in range(num_slots):
            slices = [(i, torch.randn(rank, in_features, device="cuda") / 16, torch.randn(size, rank, device="cuda"))
                      for i, size in enumerate(sizes)]
            layer.set_slot(slot, slices)
            per_slot.append(slices)
        layers.append(layer)
        adapters.append(per_slot)

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        cache.begin()
        out = [layer(x) for layer in layers]
        cache.end()
        return out

    def reference(x: torch.Tensor, token_slots: torch.Tensor) -> list[torch.Tensor]:
        offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        out = []
        for layer, per_slot in zip(layers, adapters):
            y = x @ layer.base.weight.t()
            for t in range(num_tokens):
                s = int(token_slots[t])
                for i, a, b in per_slot[s] if s >= 0 else []:
                    y[t, offsets[i]:offsets[i + 1]] += b @ (a @ x[t])
            out.append(y)
        return out

    static_x = torch.randn(num_tokens, in_features, device="cuda")
    with torch.no_grad():
        slots[:num_tokens] = torch.randint(-1, num_slots, (num_tokens,), device="cuda", dtype=torch.int32)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(static_x)  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward(static_x)
        for replay in range(3):
            new_slots = torch.randint(-1, num_slots, (num_tokens,), device="cuda", dtype=torch.int32)
            if replay == 2:
                new_slots[:] = -1  # the base model alone: the outputs are the base linears'
            slots[:num_tokens].copy_(new_slots)
            static_x.copy_(torch.randn(num_tokens, in_features, device="cuda"))
            graph.replay()
            torch.cuda.synchronize()
            for got, want in zip(static_out, reference(static_x, new_slots.cpu())):
                assert torch.allclose(got, want, atol=1e-3, rtol=1e-4), (replay, (got - want).abs().max())


def test_kernels_compile_for_sm90() -> None:
    """The per-token and grouped kernels (split-K shrinks, three-slice expands) compile for
    sm_90 at bf16 (what the interpreter cannot check), without spilling."""
    from kvserve.ops import lora
    from kvserve.ops.triton_offline import compile_kernel, resource_usage

    pointers = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b0": "*bf16", "b1": "*bf16", "b2": "*bf16", "y_ptr": "*bf16",
                "h_ptr": "*fp32", "slots_ptr": "*i32", "sorted_ptr": "*i64", "block_slots_ptr": "*i64",
                "num_padded_ptr": "*i64"}
    kernels = [
        (lora._shrink_kernel, dict(BLOCK_N=lora.SHRINK_BLOCK_N, BLOCK_K=lora.SHRINK_BLOCK_K)),
        (lora._expand_kernel, dict(BLOCK_OUT=lora.EXPAND_BLOCK_OUT, BLOCK_R=16, BLOCK_S=64)),
        (lora._sgmv_shrink_kernel, dict(PRECISION="tf32", BLOCK_M=16, BLOCK_N=16, BLOCK_K=lora.SGMV_SHRINK_BLOCK_K)),
        (lora._sgmv_shrink_kernel, dict(PRECISION="tf32", BLOCK_M=32, BLOCK_N=64, BLOCK_K=lora.SGMV_SHRINK_BLOCK_K)),
        (lora._sgmv_expand_kernel, dict(PRECISION="tf32", BLOCK_M=32, BLOCK_N=lora.SGMV_EXPAND_BLOCK_N, BLOCK_R=16)),
    ]
    for kernel, constexprs in kernels:
        registers, stack = resource_usage(compile_kernel(kernel, constexprs, types=pointers, divisible=()))
        assert stack == 0, f"{kernel.fn.__name__}: {registers} registers and {stack} bytes of stack (spilled)"
