"""The argmax kernels against torch.argmax, exactly: random rows, rows full of ties,
NaN and -inf rows, a vocabulary that is not a whole number of chunks, bf16 and fp32 logits.
On CPU the kernels run under Triton's interpreter; on a GPU at real vocabulary sizes."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.ops.argmax import CHUNK, row_argmax, triton_argmax
from tests.triton_interpreter import run_interpreted


def cases(device: str, vocabs: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for vocab in vocabs:
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(5, vocab, generator=generator).to(dtype)
            # Ties: few distinct values, the maximum in several chunks.
            logits[1] = torch.randint(0, 3, (vocab,), generator=generator).to(dtype)
            logits[2, vocab // 3] = float("nan")
            logits[2, vocab // 2] = float("nan")
            logits[3] = float("-inf")
            logits[4, -1] = 100.0  # the maximum in the last, partial chunk
            out.append(logits.to(device))
    return out


def mismatches(device: str, vocabs: tuple[int, ...]) -> list[str]:
    wrong = []
    for logits in cases(device, vocabs):
        got, expected = triton_argmax(logits), logits.argmax(dim=-1)
        if got.dtype != torch.int64 or not torch.equal(got, expected):
            wrong.append(f"{tuple(logits.shape)} {logits.dtype}: {got.tolist()} vs {expected.tolist()}")
    return wrong


def run_small_cases() -> None:
    """Under the interpreter (a subprocess): prints the mismatches as JSON."""
    print(json.dumps(mismatches("cpu", (7, CHUNK, CHUNK + 5, 2 * CHUNK + 1))))


def test_interpreted_argmax_equals_torch() -> None:
    assert json.loads(run_interpreted("tests.ops.test_argmax", "run_small_cases")) == []


def test_cpu_logits_take_torch_argmax() -> None:
    logits = torch.randn(3, 50)
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_argmax_equals_torch() -> None:
    assert mismatches("cuda", (128256, 151936, 32000, 49152, 100)) == []
    logits = torch.randn(256, 128256, device="cuda")
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
