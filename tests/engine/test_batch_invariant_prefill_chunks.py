"""Batch-invariant greedy output of a prompt longer than a step's budget: it is computed in
the same pieces beside other requests, or after a prefix-cache hit, as alone from a cold
cache, so its generated tokens and their logprobs are bit for bit those of the cold solo
run (the reference: the same prompt on a fresh engine, nothing else running).

Without canonical chunks the other requests' decodes leave the prompt pieces of another
size, and a prefix hit starts its computation at another block, or reads K/V that decode
steps wrote: the logprobs differ in the low bits."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import EngineArgs

# A budget of 64 with 8 sequences: prompts are cut into chunks of 48 (canonical_chunks.py).
ENGINE = dict(quantization="auto", batch_invariant=True, max_num_batched_tokens=64, max_num_seqs=8,
              kv_cache_memory="64MiB", max_model_len=1024)
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. Later, "
        "towers of stone carried oil lamps, then lenses that bent the light into beams seen for miles. ") * 6


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    """The embedded model as `kvserve serve` runs it on a CPU: quantization auto, batch-invariant."""
    from kvserve.engine.core import load_engine_model

    return load_engine_model(EngineArgs(model=smollm2_path, quantization="auto", batch_invariant=True))


@pytest.fixture(scope="module")
def prompt_ids(loaded) -> list[int]:
    return loaded.tokenizer.encode(TEXT)[:150]


def cold_solo(loaded, token_ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    output = LLM(loaded=loaded, **ENGINE).generate([{"prompt_token_ids": token_ids}], GREEDY)[0].outputs[0]
    return list(output.token_ids), list(output.logprobs)


def test_a_long_prompt_beside_decoding_requests_gives_its_solo_tokens_and_logprobs_bit_for_bit(loaded, prompt_ids):
    solo = cold_solo(loaded, prompt_ids)
    others = [{"prompt_token_ids": loaded.tokenizer.encode(text)} for text in ("Winter is", "A robot", "Coffee")]
    llm = LLM(loaded=loaded, **ENGINE)
    pieces: list[int] = []
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule

    def record_pieces(*args, **kwargs):
        out = schedule(*args, **kwargs)
        seq = next((scheduler.seqs[seq_id] for seq_id in out.num_scheduled_tokens
                    if scheduler.seqs[seq_id].num_prompt_tokens == len(prompt_ids)), None)
        if seq is not None and seq.num_computed_tokens < len(prompt_ids):
            pieces.append(out.num_scheduled_tokens[seq.seq_id])
        return out

    scheduler.schedule = record_pieces
    decode_long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(others + [{"prompt_token_ids": prompt_ids}], [decode_long] * 3 + [GREEDY])
    beside = outputs[-1].outputs[0]
    assert (list(beside.token_ids), list(beside.logprobs)) == solo
    assert pieces == [48, 48, 48, 6]  # cut where the budget ends: 58, 61, 31


def test_prefix_hits_give_the_cold_runs_tokens_and_logprobs_bit_for_bit(loaded, prompt_ids):
    llm = LLM(loaded=loaded, **ENGINE)
    first = llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY)[0].outputs[0]
    # Shares 7 blocks (112 tokens) with the first prompt; the hit may skip 2 chunks (96).
    branch = prompt_ids[:120] + loaded.tokenizer.encode(" Today most lighthouses are automated.")
    # A follow-up turn: its prefix holds K/V the first request's decode steps wrote.
    follow_up = prompt_ids + list(first.token_ids) + loaded.tokenizer.encode(" Tell me more.")
    stats = llm.engine.core.scheduler.prefix_cache_stats
    for token_ids, hit in ((branch, 96), (follow_up, 144)):
        before = stats.hit_tokens
        output = llm.generate([{"prompt_token_ids": token_ids}], GREEDY)[0].outputs[0]
        assert (list(output.token_ids), list(output.logprobs)) == cold_solo(loaded, token_ids)
        assert stats.hit_tokens - before == hit


def test_prompts_are_cut_canonically_only_where_the_model_routes_rows_batch_invariantly(loaded, smollm2_loaded):
    assert LLM(loaded=loaded, **ENGINE).engine.core.scheduler.canonical.chunk_size == 48
    # No quantized layers: nothing is routed, so the budget is not given up for it.
    assert LLM(loaded=smollm2_loaded, **ENGINE).engine.core.scheduler.canonical is None
