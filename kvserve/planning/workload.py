"""A planning workload from a ShareGPT file: the mean prompt and answer lengths of the
conversations `kvserve bench serve` would send from it (the same sampling and filters)."""

from __future__ import annotations

import asyncio
import math

from kvserve.benchmarks.serve_datasets import sharegpt_prompts


def sharegpt_mean_lengths(path: str, tokenizer_source: str, num_prompts: int, seed: int = 0) -> tuple[int, int]:
    """(mean prompt tokens, mean answer tokens), each rounded up."""
    from kvserve.model_executor.loader import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source)

    async def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    prompts = asyncio.run(sharegpt_prompts(path, num_prompts, seed, count_tokens))
    return (math.ceil(sum(p.prompt_tokens for p in prompts) / len(prompts)),
            math.ceil(sum(p.max_tokens for p in prompts) / len(prompts)))
