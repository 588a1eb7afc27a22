"""Batch-invariant greedy output with every default of `kvserve serve` on a CPU (quantization
auto, batch-invariant, compile-decode as serve resolves it): a short request's tokens and
logprobs are bit for bit those of its solo run on the same engine, beside a prompt longer than
a canonical chunk (its decode steps share steps with the prompt's pieces) and beside 17 other
decoding requests (18 decode rows, past the compiled decode graphs' 16).

Compiled decode graphs give other low bits than eager steps, and a step runs eager when it
holds prompt rows or more than 16 rows: with compiled decode on, both cases differ from the
solo run (all steps compiled) from the second output token on."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.input_processor import PromptType
from kvserve.entrypoints.openai.cli_args import add_cli_args as add_serve_args

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
LONG_TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. Later, "
             "towers of stone carried oil lamps, then lenses that bent the light into beams seen for miles. ") * 10
SUBJECTS = ["The ocean", "A robot", "Coffee", "The moon", "A library", "Mountains", "A lost key", "Trains",
            "Honeybees", "A violin", "Rain", "The desert", "Chess", "A lighthouse", "Bread", "Volcanoes", "A kite"]


def serve_args() -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    # A smaller KV cache and context than serve sizes for itself: neither changes a step's numbers.
    return dataclasses.replace(EngineArgs.from_cli_args(parser.parse_args([])),
                               kv_cache_memory="64MiB", max_model_len=1024)


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    from kvserve.engine.core import load_engine_model

    args = dataclasses.replace(serve_args(), model=smollm2_path)
    assert args.resolved_batch_invariant(args.resolved_device())
    fields = dataclasses.asdict(args)
    del fields["model"]
    llm = LLM(loaded=load_engine_model(args), **fields)
    compiled = llm.engine.core.runner.compiled_decode
    assert compiled is not None and not compiled.pending  # every decode step runs a graph
    return llm


def greedy_output(llm: LLM, prompts: list[PromptType], index: int) -> tuple[list[int], list[dict[int, float]]]:
    """The tokens and logprobs of prompts[index], run together with the others."""
    others = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    sampling = [GREEDY if i == index else others for i in range(len(prompts))]
    output = llm.generate(prompts, sampling)[index].outputs[0]
    return list(output.token_ids), list(output.logprobs)


def test_a_request_beside_a_long_prompt_gives_its_solo_tokens_and_logprobs(llm):
    long_ids = llm.get_tokenizer().encode(LONG_TEXT)[:300]
    assert len(long_ids) == 300  # pieces of 256 and 44, the second beside the short request's first decode
    solo = greedy_output(llm, ["Winter is"], 0)
    beside = greedy_output(llm, ["Winter is", {"prompt_token_ids": long_ids}], 0)
    assert beside == solo


def test_a_request_beside_17_decoding_requests_gives_its_solo_tokens_and_logprobs(llm):
    solo = greedy_output(llm, ["Winter is"], 0)
    beside = greedy_output(llm, [*SUBJECTS, "Winter is"], len(SUBJECTS))
    assert beside == solo


def test_a_one_token_prompt_gives_its_solo_tokens_and_logprobs_beside_a_longer_one(llm):
    """Its first decode step has one cached position: alone, the graph's context is padded."""
    one = {"prompt_token_ids": llm.get_tokenizer().encode("Winter")[:1]}
    solo = greedy_output(llm, [one], 0)
    beside = greedy_output(llm, [one, "The history of the lighthouse begins with"], 0)
    assert beside == solo
