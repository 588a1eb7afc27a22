"""`kvserve eval perplexity`: sliding-window perplexity of a text through the engine.

Windows of `window` tokens start every `stride` tokens; each window scores only the tokens
the previous window did not (the usual Hugging Face recipe), so every token after the
first is scored once with up to `window - stride` tokens of context. All windows run as
one batch of prompt-logprob requests through the real engine path (paged cache, chunked
prefill, the configured quantization).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


@dataclass
class PerplexityResult:
    perplexity: float
    num_scored_tokens: int
    num_text_tokens: int
    window: int
    stride: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_text_tokens / self.elapsed_s


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, number of newly scored tokens at the end of the window) per window.

    A window's first token has no context in it, so it is never scored there.
    """
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window={window}], got {stride}")
    windows, scored_until = [], 1  # token 0 has no context and is never scored
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        if end > scored_until:
            windows.append((start, end, min(end - scored_until, end - start - 1)))
            scored_until = end
        if end == num_tokens:
            break
    return windows


def perplexity(llm: LLM, token_ids: list[int], window: int = 512, stride: int = 256) -> PerplexityResult:
    if len(token_ids) < 2:
        raise ValueError(f"the text must have at least 2 tokens, got {len(token_ids)}")
    windows = sliding_windows(len(token_ids), window, stride)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": token_ids[start:end]} for start, end, _ in windows]
    start_time = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start_time
    total_nll, num_scored = 0.0, 0
    for (start, end, num_new), output in zip(windows, outputs):
        window_ids = token_ids[start:end]
        for position in range(len(window_ids) - num_new, len(window_ids)):
            total_nll -= output.prompt_logprobs[position][window_ids[position]]
        num_scored += num_new
    return PerplexityResult(
        math.exp(total_nll / num_scored), num_scored, len(token_ids), window, stride, elapsed
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("perplexity")
    group.add_argument("--file", required=True, help="UTF-8 text file to score.")
    group.add_argument("--window", type=int, default=512, help="Tokens of context per window.")
    group.add_argument("--stride", type=int, default=256, help="Tokens between window starts.")
    group.add_argument("--output-json", default=None, help="Write the result to this file.")


def run_from_args(args: argparse.Namespace) -> int:
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("perplexity needs a model with a tokenizer (not dummy weights)")
    result = perplexity(llm, tokenizer(text).input_ids, args.window, args.stride)
    print(
        f"perplexity {result.perplexity:.4f} over {result.num_scored_tokens} scored tokens "
        f"({result.num_text_tokens} in the text; window {result.window}, stride {result.stride}), "
        f"{result.elapsed_s:.1f} s, {result.tokens_per_s:.0f} tok/s"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(result) | {"tokens_per_s": result.tokens_per_s}, f, indent=2)
    return 0
