"""How close an e4m3 KV cache decodes to the fp32 cache on SmolLM2 (CPU), per key basis:
greedy tokens identical on the five prompts of tests/quantization/test_fp8_kv_cache.py
(decoded alone, as the test does, and inside a batch of 18 prompts), and teacher-forced
top-1 agreement and mean |logprob difference| of the fp32 cache's greedy tokens over all 18.

    python benchmarks/fp8_kv_agreement.py [hadamard] [none] [signs0] ...

hadamard: the keys' basis kvserve uses; none: keys stored as they are; signsS: the Hadamard
basis after random sign flips (seed S).
"""

from __future__ import annotations

import functools
import sys

import torch

import kvserve.attention.key_rotation as key_rotation
import kvserve.model_executor.model_runner as model_runner
from kvserve import LLM, SamplingParams
from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.loader import load_model
from tests.quantization.prompts import CONTINUATIONS, PROMPTS

TEST_PROMPTS = CONTINUATIONS[:5]
EXTRA = ["The history of the Roman Empire", "import numpy as np\n", "Photosynthesis is the process",
         "My favourite recipe for pancakes", "In 1969, astronauts", "The three laws of motion are",
         "To install Python on Linux,", "Dear hiring manager,", "The quick brown fox"]
ALL_PROMPTS = TEST_PROMPTS + [p for p in PROMPTS if p not in TEST_PROMPTS] + EXTRA
TEST_TOKENS, TOKENS = 24, 32
_HADAMARD = key_rotation.key_rotation.__wrapped__


def use_basis(name: str) -> None:
    def basis(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        matrix = _HADAMARD(head_dim, device, torch.float64)
        if name == "none":
            matrix = torch.eye(head_dim, dtype=torch.float64)
        elif name.startswith("signs"):
            generator = torch.Generator().manual_seed(int(name[5:] or 0))
            signs = torch.randint(0, 2, (head_dim,), generator=generator).double() * 2 - 1
            matrix = signs[:, None] * matrix
        return matrix.to(device=device, dtype=dtype)

    cached = functools.cache(basis)
    key_rotation.key_rotation = model_runner.key_rotation = cached


def greedy(llm: LLM, prompts: list[str], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def teacher_forced(llm: LLM, reference: list[list[int]]) -> list[list[dict[int, float]]]:
    tokenizer = llm.engine.tokenizer
    logprobs = []
    for prompt, tokens in zip(ALL_PROMPTS, reference, strict=True):
        ids = tokenizer(prompt).input_ids
        out = llm.generate({"prompt_token_ids": ids + tokens}, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
        logprobs.append([out.prompt_logprobs[len(ids) + i] for i in range(len(tokens))])
    return logprobs


def main() -> None:
    loaded = load_model(default_model_path(), dtype=torch.float32)
    fp32 = LLM(loaded=loaded, kv_cache_memory="128MiB")
    reference_alone = greedy(fp32, TEST_PROMPTS, TEST_TOKENS)
    reference = greedy(fp32, ALL_PROMPTS, TOKENS)
    reference_logprobs = teacher_forced(fp32, reference)
    for name in sys.argv[1:] or ["hadamard"]:
        use_basis(name)
        fp8 = LLM(loaded=loaded, kv_cache_memory="128MiB", kv_cache_dtype="fp8")
        alone = sum(a == b for a, b in zip(greedy(fp8, TEST_PROMPTS, TEST_TOKENS), reference_alone))
        batched = greedy(fp8, ALL_PROMPTS, TOKENS)
        in_batch = sum(a[:TEST_TOKENS] == b[:TEST_TOKENS] for a, b in zip(batched[:5], reference[:5]))
        identical = sum(a == b for a, b in zip(batched, reference))
        agree = total = 0
        error = 0.0
        for ref_positions, positions, tokens in zip(reference_logprobs, teacher_forced(fp8, reference), reference):
            for ref, entry, token in zip(ref_positions, positions, tokens):
                agree += max(entry, key=entry.get) == token
                error += abs(ref[token] - entry.get(token, -30.0))
                total += 1
        print(f"{name}: test prompts identical for {TEST_TOKENS} tokens: {alone}/5 alone, {in_batch}/5 in the batch "
              f"of {len(ALL_PROMPTS)}; all {len(ALL_PROMPTS)} identical for {TOKENS}: {identical}; teacher-forced "
              f"top-1 {agree}/{total} ({agree / total:.1%}), mean |logprob difference| {error / total:.4f}", flush=True)


if __name__ == "__main__":
    main()
