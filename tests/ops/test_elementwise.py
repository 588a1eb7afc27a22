"""The fused Triton elementwise kernels against the torch path they replace.

Without a GPU the kernels run under Triton's interpreter (fp32 and fp16, small shapes) in
one subprocess (tests.triton_interpreter); the bf16 and real-size cases run on CUDA
(marked gpu). The norm and SwiGLU kernels' fp8 outputs (Fp8Rows) must be exactly the
torch per-token quantization of their unfused outputs.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_executor.layers.layernorm import RMSNorm
from tests.fp8_reference import fp8_mismatches
from tests.triton_interpreter import run_interpreted

# (tokens, hidden, heads, kv heads, head dim, intermediate)
# (tokens, hidden, heads, kv heads, head dim, intermediate); head dims 40 and 80 have halves
# that are not powers of two (Qwen2.5-VL's vision tower has 80).
SMALL_SHAPES = [(1, 64, 4, 2, 16, 96), (7, 96, 6, 2, 40, 200)]
GPU_SHAPES = [(1, 4096, 32, 8, 128, 14336), (37, 896, 14, 2, 64, 4864), (300, 576, 9, 3, 64, 1536),
              (64, 1280, 16, 16, 80, 3420)]
# The kernels quantize 16-bit rows only (what the fp8 linears take).
FP8_ROWS_DTYPES = (torch.float16, torch.bfloat16)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch path of apply_rotary (run on CPU, where it does not dispatch to Triton)."""
    from kvserve.model_executor.layers.rotary import apply_rotary

    return apply_rotary(x.cpu(), cos.cpu(), sin.cpu())


def check_shape(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> dict[str, float]:
    """Largest difference of each kernel from the torch path, in units of the dtype's eps
    relative to the reference's magnitude."""
    from kvserve.ops import elementwise

    tokens, hidden, heads, kv_heads, head_dim, inter = shape
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    errors = {}

    def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
        scale = ref.float().abs().max().clamp_min(1e-6)
        return ((got.cpu().float() - ref.float()).abs().max() / scale).item()

    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden, generator=gen) + 0.5
    norm = norm.to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ref_out, ref_residual = norm(x, residual.clone())
    got_residual = residual.clone().to(device)
    got = elementwise.add_rms_norm(x.to(device), norm.weight.to(device), 1e-5, got_residual)
    errors["add_rms_norm"] = max(rel(got, ref_out), rel(got_residual, ref_residual))
    errors["rms_norm"] = rel(elementwise.add_rms_norm(x.to(device), norm.weight.to(device), 1e-5),
                             norm(x))
    if dtype in FP8_ROWS_DTYPES:
        # Fp8Rows: the unfused kernel's rows quantized per token (exact), the residual as unfused.
        fp8_residual = residual.clone().to(device)
        rows = elementwise.add_rms_norm(x.to(device), norm.weight.to(device), 1e-5, fp8_residual, fp8=True)
        errors["add_rms_norm_fp8_mismatches"] = fp8_mismatches(rows.values, rows.scales, got) + int(
            (fp8_residual.cpu() != got_residual.cpu()).sum())
        rows = elementwise.add_rms_norm(x.to(device), norm.weight.to(device), 1e-5, fp8=True)
        errors["rms_norm_fp8_mismatches"] = fp8_mismatches(
            rows.values, rows.scales, elementwise.add_rms_norm(x.to(device), norm.weight.to(device), 1e-5))

    # q and k as strided views of one fused projection, as the model has them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    pristine = qkv.clone()  # on CPU, qkv.to(device) below is qkv itself, rotated in place
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    q_ref = torch_rotary(qkv[:, : heads * head_dim].view(tokens, heads, head_dim), cos, sin)
    qkv_dev = qkv.to(device)
    q = qkv_dev[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv_dev[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    k_ref = torch_rotary(k.cpu().clone(), cos, sin)
    elementwise.rotary_(q, cos.to(device), sin.to(device))
    elementwise.rotary_(k, cos.to(device), sin.to(device))
    errors["rotary"] = max(rel(q, q_ref), rel(k, k_ref))
    untouched = qkv_dev[:, (heads + kv_heads) * head_dim :].cpu()
    errors["rotary_leaves_v"] = rel(untouched, qkv[:, (heads + kv_heads) * head_dim :])
    # The attention backend's form: q and k in one launch where k's heads follow q's (views
    # of the projection), in two where they do not (separate tensors, e.g. after q/k norms).
    for name, layout in (("adjacent", pristine.clone().to(device)), ("separate", None)):
        if layout is None:
            q = pristine[:, : heads * head_dim].reshape(tokens, heads, head_dim).clone().to(device)
            k = pristine[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(
                tokens, kv_heads, head_dim).clone().to(device)
        else:
            q = layout[:, : heads * head_dim].view(tokens, heads, head_dim)
            k = layout[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        elementwise.rotary_queries_and_keys_(q, k, cos.to(device), sin.to(device))
        errors[f"rotary_queries_and_keys_{name}"] = max(rel(q, q_ref), rel(k, k_ref))
        if layout is not None:
            errors["rotary_queries_and_keys_leaves_v"] = rel(layout[:, (heads + kv_heads) * head_dim :],
                                                             pristine[:, (heads + kv_heads) * head_dim :])

    # Qwen3's q/k norms in one launch, in place on the projection's view, against RMSNorm
    # on each (fp32 reference: the torch path, upcast where CPU lacks the half kernels).
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    q_norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5
    k_norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    layout = pristine.clone().to(device)
    heads_view = layout[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    elementwise.qk_rms_norm_(heads_view, heads, q_norm.weight.to(device), k_norm.weight.to(device), 1e-6)
    q_pristine = pristine[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    k_pristine = pristine[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    errors["qk_rms_norm"] = max(rel(heads_view[:, :heads], q_norm(q_pristine)),
                                rel(heads_view[:, heads:], k_norm(k_pristine)))
    errors["qk_rms_norm_leaves_v"] = rel(layout[:, (heads + kv_heads) * head_dim :],
                                         pristine[:, (heads + kv_heads) * head_dim :])

    gate_up = (torch.randn(tokens, 2 * inter, generator=gen) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    activation = elementwise.silu_and_mul(gate_up.to(device))
    errors["silu_and_mul"] = rel(activation, F.silu(gate) * up)
    if dtype in FP8_ROWS_DTYPES:
        rows = elementwise.silu_and_mul(gate_up.to(device), fp8=True)
        errors["silu_and_mul_fp8_mismatches"] = fp8_mismatches(rows.values, rows.scales, activation)
    return {name: error if name.endswith("_mismatches") else error / torch.finfo(dtype).eps
            for name, error in errors.items()}


# In eps of the dtype: the kernels round where the torch path rounds, so they differ by at
# most an ulp or two (fp32: transcendental and reduction order).
MAX_EPS = {torch.float32: 64, torch.float16: 2, torch.bfloat16: 2}


def assert_kernels_match(errors: dict[str, float], dtype: torch.dtype) -> None:
    assert errors["rotary_leaves_v"] == errors["rotary_queries_and_keys_leaves_v"] == 0
    assert errors["qk_rms_norm_leaves_v"] == 0
    assert all(error == 0 for name, error in errors.items() if name.endswith("_mismatches")), errors
    assert all(error <= MAX_EPS[dtype] for error in errors.values()), errors


def run_small_cases() -> None:
    """Subprocess entry: print {case: {kernel: error in eps}} as JSON."""
    results = {
        f"{shape}-{dtype}": check_shape(shape, dtype, "cpu")
        for shape in SMALL_SHAPES for dtype in (torch.float32, torch.float16)
    }
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, float]]:
    return json.loads(run_interpreted("tests.ops.test_elementwise", "run_small_cases"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=str)
def test_interpreted_kernels_match_torch(shape, dtype, interpreted_results):
    assert_kernels_match(interpreted_results[f"{shape}-{dtype}"], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_cuda_kernels_match_torch(shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert_kernels_match(check_shape(shape, dtype, "cuda"), dtype)
