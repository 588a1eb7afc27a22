"""The fused mixture-of-experts kernels against a per-expert loop in fp32 written here: odd
token counts, 8 to 128 experts, top-k 1 to 8, fp32 and bf16. On CPU the kernels run under
Triton's interpreter on small widths; on a GPU at real widths and under CUDA-graph replay."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F

from kvserve.ops.expert_weights import ExpertWeights
from kvserve.ops.fused_moe import align_by_expert, fused_experts
from kvserve.ops.fused_moe_configs import default_config as default_moe_config
from kvserve.ops.fused_moe_gemv import GemvTile, experts_gemv, uses_gemv
from kvserve.quantization.fp8 import quantize_fp8
from kvserve.quantization.int4 import dequantize_int4, quantize_int4
from kvserve.quantization.int8 import quantize_int8
from kvserve.ops.fused_moe_configs import MoEConfig, default_config, device_file, shape_key, tuned_config
from tests.triton_interpreter import run_interpreted


def reference(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
    """Each token through each of its chosen experts, one at a time, in fp32."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for expert, weight in zip(chosen[token].tolist(), weights[token].float()):
            gate, up = (w13[expert] @ x[token]).chunk(2)
            out[token] += weight * (w2[expert] @ (F.silu(gate) * up))
    return out


def routing(tokens: int, experts: int, top_k: int, generator: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=generator)
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return chosen, weights / weights.sum(dim=-1, keepdim=True)


def quantized_experts(weights: torch.Tensor, fmt: str) -> tuple[ExpertWeights, torch.Tensor]:
    """weights [E, N, K] fp32 quantized per expert by kvserve's quantizers: (the stacked kernel
    form, the dequantized weights the reference multiplies). fmt: dense, int4-gG, int8, fp8,
    fp8-gG."""
    if fmt == "dense":
        return ExpertWeights(weights), weights
    stored, scales, offsets, dequantized = [], [], [], []
    for w in weights:
        if fmt.startswith("int4"):
            group = int(fmt.split("-g")[1])
            q, scale, minimum = quantize_int4(w, group)
            stored.append(q[:, 0::2] | (q[:, 1::2] << 4))
            offsets.append(minimum)
            dequantized.append(dequantize_int4(q, scale, minimum))
        elif fmt.startswith("fp8"):
            group = int(fmt.split("-g")[1]) if "-g" in fmt else w.shape[1]
            rows = w.reshape(-1, group)  # each group of a row quantized as one row
            q, scale = quantize_fp8(rows)
            q, scale = q.reshape(w.shape), scale.reshape(w.shape[0], -1)
            stored.append(q)
            dequantized.append((q.float().reshape(w.shape[0], -1, group) * scale[..., None]).reshape(w.shape))
        else:
            group = w.shape[1]
            q, scale = quantize_int8(w)
            scale = scale[:, None]
            stored.append(q)
            dequantized.append(q.float() * scale)
        scales.append(scale)
    return (ExpertWeights(torch.stack(stored), torch.stack(scales).float(),
                          torch.stack(offsets).float() if offsets else None, group, fmt.startswith("int4")),
            torch.stack(dequantized))


def to_device(weights: ExpertWeights, device: str, dtype: torch.dtype) -> ExpertWeights:
    stored = weights.weight.to(device, dtype) if weights.scale is None else weights.weight.to(device)
    return weights._replace(weight=stored, scale=None if weights.scale is None else weights.scale.to(device),
                            offset=None if weights.offset is None else weights.offset.to(device))


def grouped(x, chosen, weights, w13, w2):
    """The grouped GEMMs whatever the token count."""
    return fused_experts(x, chosen, weights, w13, w2, default_moe_config(chosen.shape[0]))


def gemv(x, chosen, weights, w13, w2):
    """The pair GEMVs whatever the token count, with small tiles (masks, several groups a
    tile) and the down GEMV's k in 3 splits."""
    tile = GemvTile(16, 64, 4)
    return experts_gemv(x, chosen, weights, w13, w2, tile, tile, num_splits=3, summed_down=False)


def gemv_summed(x, chosen, weights, w13, w2):
    """The pair GEMVs with the down GEMV summing each token's choices (no split, no combine)."""
    tile = GemvTile(16, 64, 4)
    return experts_gemv(x, chosen, weights, w13, w2, tile, tile, summed_down=True)


@functools.lru_cache(maxsize=1)
def random_experts(experts: int, hidden: int, intermediate: int, fmt: str
                   ) -> tuple[tuple[ExpertWeights, torch.Tensor], tuple[ExpertWeights, torch.Tensor]]:
    """Random experts w13 [E, 2I, H] and w2 [E, H, I] in `fmt`, each with the dequantized
    weights the reference multiplies. The same for every case of a shape and format: making
    and quantizing 128 experts at real widths takes the host seconds, which a GPU test's
    cases (errors() groups them) would otherwise pay each time."""
    generator = torch.Generator().manual_seed(experts * 1000 + hidden)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate**0.5
    return quantized_experts(w13, fmt), quantized_experts(w2, fmt)


def errors(device: str, cases: list[tuple], hidden: int, intermediate: int, run=fused_experts) -> list[str]:
    """Cases (tokens, experts, top_k, activation dtype, weight format); `run`: fused_experts
    (the path it picks), grouped or gemv. Cases of one expert count and format run one
    after another, on the same random experts."""
    generator = torch.Generator().manual_seed(0)
    wrong = []
    for tokens, experts, top_k, dtype, fmt in sorted(cases, key=lambda case: (case[1], case[4])):
        chosen, weights = routing(tokens, experts, top_k, generator)
        x = torch.randn(tokens, hidden, generator=generator)
        (w13, dense13), (w2, dense2) = random_experts(experts, hidden, intermediate, fmt)
        # Dense weights are rounded to the activation dtype as the kernel reads them.
        if fmt == "dense":
            dense13, dense2 = dense13.to(dtype), dense2.to(dtype)
        expected = reference(x.to(dtype), chosen, weights, dense13, dense2)
        got = run(x.to(device, dtype), chosen.to(device), weights.to(device),
                  to_device(w13, device, dtype), to_device(w2, device, dtype)).float().cpu()
        # bf16: the intermediate activations (and dequantized weights) are rounded to bf16.
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        error = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)
        if not error <= tol:
            wrong.append(f"T={tokens} E={experts} k={top_k} {dtype} {fmt}: relative error {error:.2e}")
    return wrong


INTERPRETED_CASES = [
    (1, 8, 2, torch.float32, "dense"), (33, 60, 4, torch.float32, "dense"), (7, 128, 8, torch.bfloat16, "dense"),
    (5, 8, 2, torch.float32, "int4-g32"), (5, 8, 2, torch.bfloat16, "int4-g32"), (5, 8, 2, torch.float32, "int8"),
    (5, 8, 2, torch.float32, "fp8-g32"),
]


def run_small_cases() -> None:
    """Under the interpreter (a subprocess): the mismatches as JSON. Widths that are not
    multiples of the tiles (hidden 64 with 96-wide tiles' masks, intermediate 96) exercise
    the masks; quantized widths are multiples of their groups."""
    print(json.dumps(errors("cpu", INTERPRETED_CASES, hidden=64, intermediate=96, run=grouped)))


GEMV_CASES = [
    (1, 8, 2, torch.float32, "dense"), (2, 128, 8, torch.bfloat16, "dense"), (1, 8, 2, torch.float32, "int4-g32"),
    (3, 8, 2, torch.bfloat16, "int4-g32"), (1, 8, 1, torch.float32, "int8"), (2, 8, 2, torch.float32, "fp8-g32"),
    (1, 8, 2, torch.float32, "fp8"),
]


def run_gemv_cases() -> None:
    """The pair GEMVs under the interpreter: widths not multiples of the 16 x 64 tiles for
    dense weights (hidden 80, intermediate 96), 32-wide groups two a tile, k split in 3."""
    wrong = []
    for run in (gemv, gemv_summed):
        wrong += errors("cpu", [c for c in GEMV_CASES if c[4] == "dense"], hidden=80, intermediate=96, run=run)
        wrong += errors("cpu", [c for c in GEMV_CASES if c[4] != "dense"], hidden=64, intermediate=128, run=run)
    print(json.dumps(wrong))


def test_interpreted_gemv_experts_equal_the_loop() -> None:
    assert json.loads(run_interpreted("tests.ops.test_fused_moe", "run_gemv_cases")) == []


def test_few_pairs_take_the_gemvs() -> None:
    """One token always; dense experts up to a quarter of the experts in pairs (Mixtral's 8:
    one token; Qwen3's 128: 4 tokens); packed ones up to one pair an expert."""
    assert uses_gemv(2, 8, 2, packed=False) and not uses_gemv(4, 8, 2, packed=False)
    assert uses_gemv(8, 8, 2, packed=True) and not uses_gemv(10, 8, 2, packed=True)
    assert uses_gemv(32, 128, 8, packed=False) and not uses_gemv(40, 128, 8, packed=False)
    assert uses_gemv(128, 128, 8, packed=True) and not uses_gemv(136, 128, 8, packed=True)
    assert uses_gemv(1, 8, 1, packed=False) and not uses_gemv(3, 8, 1, packed=False)


def test_interpreted_fused_experts_equal_the_loop() -> None:
    assert json.loads(run_interpreted("tests.ops.test_fused_moe", "run_small_cases")) == []


ALIGNMENT_CASES = [(1, 8, 2, 16), (7, 60, 4, 16), (257, 128, 8, 16), (33, 8, 8, 16), (257, 8, 2, 64),
                   (300, 60, 4, 128), (600, 8, 2, 16)]


def alignment_errors(device: str) -> list[str]:
    """What is wrong with align_by_expert's output on each case: every pair exactly once, in
    a block of its own expert, padding only the sentinel, the counts and lengths exact."""
    wrong = []
    for tokens, experts, top_k, block in ALIGNMENT_CASES:
        chosen, _ = routing(tokens, experts, top_k, torch.Generator().manual_seed(tokens))
        sorted_pairs, block_experts, num_padded = (
            t.cpu() for t in align_by_expert(chosen.to(device), experts, block))
        pairs = tokens * top_k
        counts = torch.bincount(chosen.flatten(), minlength=experts)
        padded_total = int(((counts + block - 1) // block * block).sum())
        case = f"T={tokens} E={experts} k={top_k} block={block}"
        if num_padded.item() != padded_total or sorted_pairs.shape[0] != pairs + experts * (block - 1):
            wrong.append(f"{case}: lengths {num_padded.item()}, {sorted_pairs.shape[0]}")
            continue
        used = sorted_pairs[:padded_total]
        real = used[used < pairs]
        if sorted(real.tolist()) != list(range(pairs)):
            wrong.append(f"{case}: pairs missing or repeated")
        if not (sorted_pairs[padded_total:] == pairs).all():
            wrong.append(f"{case}: past the end is not the sentinel")
        if not (block_experts[padded_total // block:] == experts).all():
            wrong.append(f"{case}: blocks past the end name an expert")
        for index, expert in enumerate(block_experts[: padded_total // block].tolist()):
            members = used[index * block : (index + 1) * block]
            members = members[members < pairs]
            if len(members) == 0 or not (chosen.flatten()[members] == expert).all():
                wrong.append(f"{case}: block {index} is not all expert {expert}")
    return wrong


def run_alignment_cases() -> None:
    print(json.dumps(alignment_errors("cpu")))


def test_interpreted_alignment_groups_every_pair_by_expert() -> None:
    assert json.loads(run_interpreted("tests.ops.test_fused_moe", "run_alignment_cases")) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_alignment_groups_every_pair_by_expert() -> None:
    assert alignment_errors("cuda") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fused_experts_equal_the_loop() -> None:
    cases = [(t, e, k, dtype, "dense") for t in (1, 7, 33, 257) for e, k in ((8, 2), (60, 4), (128, 8), (8, 1))
             for dtype in (torch.bfloat16, torch.float16)]
    assert errors("cuda", cases, hidden=1024, intermediate=704) == []
    assert errors("cuda", cases, hidden=1024, intermediate=704, run=grouped) == []
    assert errors("cuda", [c for c in cases if c[0] <= 7], hidden=1024, intermediate=704, run=gemv) == []
    assert errors("cuda", [c for c in cases if c[0] <= 7], hidden=1024, intermediate=704, run=gemv_summed) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_quantized_experts_equal_the_loop_on_their_dequantized_weights() -> None:
    cases = [(t, e, k, dtype, fmt) for t in (1, 7, 33, 257) for e, k in ((8, 2), (128, 8))
             for dtype in (torch.bfloat16, torch.float16) for fmt in ("int4-g128", "int4-g64", "int8", "fp8", "fp8-g128")]
    assert errors("cuda", cases, hidden=1024, intermediate=768) == []
    assert errors("cuda", cases, hidden=1024, intermediate=768, run=grouped) == []
    assert errors("cuda", [c for c in cases if c[0] <= 7], hidden=1024, intermediate=768, run=gemv) == []
    assert errors("cuda", [c for c in cases if c[0] <= 7], hidden=1024, intermediate=768, run=gemv_summed) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fused_experts_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed with other routings of the same batch size: no host reads."""
    generator = torch.Generator().manual_seed(1)
    tokens, experts, top_k, hidden, intermediate = 8, 8, 2, 512, 384
    w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5).cuda().bfloat16()
    w2 = (torch.randn(experts, hidden, intermediate, generator=generator) / intermediate**0.5).cuda().bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    chosen, weights = (t.cuda() for t in routing(tokens, experts, top_k, generator))
    fused_experts(x, chosen, weights, ExpertWeights(w13), ExpertWeights(w2))  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, chosen, weights, ExpertWeights(w13), ExpertWeights(w2))
    for _ in range(3):
        new_chosen, new_weights = routing(tokens, experts, top_k, generator)
        chosen.copy_(new_chosen)
        weights.copy_(new_weights)
        x.copy_(torch.randn(tokens, hidden, generator=generator))
        graph.replay()
        expected = reference(x.cpu(), chosen.cpu(), weights.cpu(), w13.cpu(), w2.cpu())
        torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2 * expected.abs().max().item(), rtol=0)


def test_tuned_configs_load_by_nearest_token_count() -> None:
    """The shipped H200 file: each tuned shape resolves to the entry of the nearest tuned token
    count; untuned shapes and devices get the default."""
    raw = json.loads(device_file("NVIDIA H200").read_text())
    key = shape_key(8, 4096, 14336, "bfloat16")
    tuned_tokens = sorted(int(t) for t in raw[key])
    for tokens in (1, 3, 100, 10_000):
        nearest = min(tuned_tokens, key=lambda t: abs(t - tokens))
        expected = MoEConfig.from_json(raw[key][str(nearest)])
        assert tuned_config("NVIDIA H200", tokens, 8, 4096, 14336, "bfloat16") == expected
    assert tuned_config("NVIDIA H200", 1, 8, 4096, 14336, "float16") == default_config(1)
    assert tuned_config("Some Other GPU", 512, 8, 4096, 14336, "bfloat16") == default_config(512)
