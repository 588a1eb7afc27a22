"""Prompts for the serving benchmark: random token ids (with random images for
random-mm, or behind a few shared prefixes for shared-prefix), or ShareGPT conversations."""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import pairwise

# vLLM's ShareGPT sampling filters, so the same file gives comparable workloads.
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048
HUMAN_ROLES = {"human", "user"}
MODEL_ROLES = {"gpt", "assistant", "chatgpt", "bard"}


@dataclass
class BenchPrompt:
    prompt: str | list[int]  # text, or token ids (sent as-is to /v1/completions)
    prompt_tokens: int
    max_tokens: int
    images: list[str] = field(default_factory=list)  # data: URLs, sent as chat image_url parts


def random_prompts(
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    token_range: tuple[int, int],
    seed: int,
) -> list[BenchPrompt]:
    """Token ids uniform in [low, high); lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        ids = [rng.randrange(*token_range) for _ in range(rng.randint(*input_len))]
        prompts.append(BenchPrompt(ids, len(ids), rng.randint(*output_len)))
    return prompts


def shared_prefix_prompts(
    num: int,
    num_prefixes: int,
    prefix_len: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    token_range: tuple[int, int],
    seed: int,
) -> list[BenchPrompt]:
    """W4 over several groups: `num_prefixes` random prefixes of `prefix_len` token ids (a
    system prompt each), every request one of them (in turn, then shuffled) followed by a
    random question of input_len tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*token_range) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    groups = [index % num_prefixes for index in range(num)]
    rng.shuffle(groups)
    prompts = []
    for group in groups:
        ids = prefixes[group] + [rng.randrange(*token_range) for _ in range(rng.randint(*input_len))]
        prompts.append(BenchPrompt(ids, len(ids), rng.randint(*output_len)))
    return prompts


def random_image_urls(num_requests: int, images_per_request: int, size: tuple[int, int],
                      seed: int) -> list[list[str]]:
    """JPEG data URLs of seeded random-noise images, distinct across requests (so that no
    encoder or prefix cache serves one request from another's image)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = size
    urls = []
    for _ in range(num_requests):
        request_urls = []
        for _ in range(images_per_request):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
            request_urls.append("data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode())
        urls.append(request_urls)
    return urls


def _first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    """The first human turn and the model turn that answers it."""
    for turn, answer in pairwise(conversation):
        if turn.get("from") in HUMAN_ROLES and answer.get("from") in MODEL_ROLES:
            return turn["value"], answer["value"]
    return None


async def sharegpt_prompts(
    path: str, num: int, seed: int, count_tokens: Callable[[str], Awaitable[int]]
) -> list[BenchPrompt]:
    """`num` conversations in a seeded random order; max_tokens is the reference answer's length."""
    try:
        with open(path) as f:
            exchanges = [e for item in json.load(f) if (e := _first_exchange(item.get("conversations", [])))]
    except (OSError, json.JSONDecodeError, AttributeError, TypeError) as error:
        raise ValueError(
            f"cannot read ShareGPT file {path} (a list of {{'conversations': [...]}}): {error}"
        ) from error
    random.Random(seed).shuffle(exchanges)
    prompts = []
    for prompt, answer in exchanges:
        prompt_tokens, answer_tokens = await count_tokens(prompt), await count_tokens(answer)
        if (
            min(prompt_tokens, answer_tokens) < SHAREGPT_MIN_TOKENS
            or prompt_tokens > SHAREGPT_MAX_PROMPT_TOKENS
            or prompt_tokens + answer_tokens > SHAREGPT_MAX_TOTAL_TOKENS
        ):
            continue
        prompts.append(BenchPrompt(prompt, prompt_tokens, answer_tokens))
        if len(prompts) == num:
            return prompts
    raise ValueError(f"{path} has only {len(prompts)} usable conversations; --num-prompts is {num}")
