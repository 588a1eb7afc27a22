"""Greedy output under serve's CPU defaults (quantization auto, batch-invariant) does not
depend on how many requests run together: the same prompts at 16, 17 and 32 concurrent
streams give each request the token ids of its solo run (the reference: every prompt run
alone). Before the batch-invariant plan, 7 of 17 and 14 of 32 differed (the LM head and the
linears switched from their int8/int4 kernels to dense copies past a few rows).

The prompts are short (under one 16-token block, so no prefix-cache hits; 32 of them fit the
512-token step budget whole), so each prompt is computed in one piece at every batch size:
docs/batch-invariance.md says what such splits leave to chance."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import EngineArgs
from kvserve.entrypoints.openai.cli_args import add_cli_args as add_serve_args

_SUBJECTS = ["The ocean", "A robot", "Winter", "Coffee", "The moon", "A library", "Mountains", "A lost key",
             "Trains", "Honeybees", "A violin", "Rain", "The desert", "Chess", "A lighthouse", "Bread",
             "Volcanoes", "A kite", "Owls", "The city at night", "Glaciers", "A garden", "Thunder", "Maps",
             "A bicycle", "Clocks", "The forest", "A river", "Snow", "Stars", "A market", "Paper boats"]


@pytest.mark.slow
def test_greedy_tokens_at_16_17_and_32_streams_equal_the_solo_runs():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert args.resolved_batch_invariant(args.resolved_device())
    llm = LLM(**dataclasses.asdict(args))
    prompts = [f"{subject} is" for subject in _SUBJECTS]
    tokenizer = llm.get_tokenizer()
    lengths = [len(tokenizer.encode(prompt)) for prompt in prompts]
    assert max(lengths) < 16 and sum(lengths) <= args.resolved_max_num_batched_tokens(args.resolved_device())
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    for streams in (16, 17, 32):
        together = [output.outputs[0].token_ids for output in llm.generate(prompts[:streams], params)]
        differing = [i for i in range(streams) if together[i] != solo[i]]
        assert not differing, f"{len(differing)}/{streams} differ from their solo run: {differing}"
