"""Perplexity through the engine equals one computed independently with transformers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from kvserve.eval.perplexity import perplexity, sliding_windows

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and wrote the weather in a leather book: wind from the "
    "north-west, a swell rising, two fishing boats returning late. In winter the storms came "
    "in long grey lines from the sea, and the keeper counted the seconds between the flashes "
    "of lightning and the roll of thunder, as his father had taught him. Ships passed far "
    "out, their lights small and steady, and he wondered where they were bound: to ports of "
    "spice and cotton, to cold harbours in the north, or home. In spring the gulls returned, "
    "and children from the village walked along the cliff path to ask whether they might see "
    "the lamp. He always said yes, and showed them how the clockwork turned the lens, how a "
    "small flame became a beam that reached twenty miles, and why the light must never fail. "
) * 3


def test_sliding_windows_score_every_token_once():
    assert sliding_windows(10, 4, 2) == [(0, 4, 3), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    assert sliding_windows(10, 4, 4) == [(0, 4, 3), (4, 8, 3), (8, 10, 1)]
    assert sliding_windows(3, 8, 4) == [(0, 3, 2)]


def _transformers_perplexity(model, ids: list[int], window: int, stride: int) -> float:
    """The Hugging Face recipe, written out: score tokens not scored by the previous window."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        window_ids = torch.tensor([ids[begin:end]])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(window_ids).logits[0].double(), dim=-1)
        first = max(prev_end, begin + 1)  # a window's first token has no context
        for position in range(first, end):
            nll -= logprobs[position - begin - 1, ids[position]].item()
            count += 1
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / count)


def test_perplexity_matches_transformers(smollm2_llm, smollm2_hf):
    ids = smollm2_llm.get_tokenizer()(TEXT).input_ids
    assert len(ids) > 400
    result = perplexity(smollm2_llm, ids, window=128, stride=64)
    expected = _transformers_perplexity(smollm2_hf, ids, window=128, stride=64)
    assert result.num_scored_tokens == len(ids) - 1
    assert abs(result.perplexity / expected - 1) < 1e-3


# The CLI wrapper of the tool checked above (test_perplexity_matches_transformers); slow
# to keep the default suite within CI's 10 minutes.
@pytest.mark.slow
def test_cli_prints_the_perplexity(tmp_path, smollm2_llm):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT[:600])
    ids = smollm2_llm.get_tokenizer()(TEXT[:600]).input_ids
    expected = perplexity(smollm2_llm, ids, window=64, stride=32).perplexity
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "WARNING", "eval",
         "perplexity", "--file", str(text_file), "--window", "64", "--stride", "32",
         "--kv-cache-memory", "64MiB", "--max-model-len", "1024"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"perplexity {expected:.4f}" in result.stdout
