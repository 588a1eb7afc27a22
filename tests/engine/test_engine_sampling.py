"""Engine-level sampling behaviour on the real model: seeds, n > 1 with shared blocks,
stop strings and tokens, logprobs against transformers, abort."""

from __future__ import annotations

import torch

from kvserve import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _tokens(output) -> list[int]:
    return output.outputs[0].token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2_llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = smollm2_llm.generate(PROMPT, seeded)[0]
    others = SamplingParams(temperature=1.0, max_tokens=30)
    batch = smollm2_llm.generate(
        ["The weather today", PROMPT, "In 1492, Columbus", PROMPT],
        [others, seeded, others, SamplingParams(temperature=0.9, seed=99, max_tokens=24)],
    )
    assert _tokens(batch[1]) == _tokens(alone)
    assert _tokens(batch[3]) != _tokens(alone)  # a different seed gives a different sample


def test_n_samples_share_prompt_blocks_and_copy_on_write(smollm2_llm):
    engine = smollm2_llm.engine
    block_size = engine.core.cache_config.block_size
    prompt = list(range(2000, 2000 + 2 * block_size + 5))  # two full blocks and a partial one
    engine.add_request(
        "fork", {"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    )
    request = engine.core.requests["fork"]
    engine.step()  # prefill, then the prompt forks into three samples
    tables = [engine.core.kv_cache.block_ids(seq.seq_id) for seq in request.sequences]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [engine.core.kv_cache.pool.blocks[b].ref_count for b in tables[0]] == [3, 3, 3]

    engine.step()  # each sample writes its first token into the shared partial block
    tables = [engine.core.kv_cache.block_ids(seq.seq_id) for seq in request.sequences]
    full_blocks = tables[0][:2]
    assert all(table[:2] == full_blocks for table in tables)
    assert [engine.core.kv_cache.pool.blocks[b].ref_count for b in full_blocks] == [3, 3]
    partial_blocks = {table[2] for table in tables}
    assert len(partial_blocks) == 3  # two copies were made; the last writer kept the original
    assert all(engine.core.kv_cache.pool.blocks[b].ref_count == 1 for b in partial_blocks)

    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks


def test_greedy_n_samples_equal_single_greedy(smollm2_llm):
    single = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0]
    many = smollm2_llm.generate(PROMPT, SamplingParams(n=3, temperature=0.0, max_tokens=12))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert all(c.token_ids == _tokens(single) and c.text == single.outputs[0].text for c in many.outputs)


def test_stop_string_spanning_tokens_is_never_emitted(smollm2_llm):
    free = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40))[0]
    text = free.outputs[0].text
    stop = text[10:17]  # seven characters from inside the text, usually across a token edge
    first = text.index(stop)
    stopped = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))[0]
    completion = stopped.outputs[0]
    assert completion.text == text[:first]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


def test_stop_token_ids_and_max_tokens(smollm2_llm):
    free = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20))[0]
    tokens = _tokens(free)
    assert free.outputs[0].finish_reason == "length" and len(tokens) == 20
    stop_token = tokens[6]
    stopped = smollm2_llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token])
    )[0]
    cut = tokens.index(stop_token) + 1
    assert _tokens(stopped) == tokens[:cut]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop_token


def test_logprobs_match_transformers(smollm2_llm, smollm2_hf):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    output = smollm2_llm.generate(PROMPT, params)[0]
    ids = output.prompt_token_ids + _tokens(output)
    with torch.inference_mode():
        logits = smollm2_hf(torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    num_prompt = len(output.prompt_token_ids)

    assert output.prompt_logprobs[0] is None
    for position in range(1, num_prompt):
        entry = output.prompt_logprobs[position]
        expected = reference[position - 1]
        top2 = expected.topk(2).indices.tolist()
        assert set(top2) | {ids[position]} == set(entry)
        for token_id, logprob in entry.items():
            assert abs(logprob - expected[token_id].item()) < 1e-3

    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = reference[num_prompt - 1 + step]
        assert set(expected.topk(3).indices.tolist()) | {token_id} == set(entry)
        assert abs(entry[token_id] - expected[token_id].item()) < 1e-3
    assert abs(completion.cumulative_logprob - sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs))) < 1e-5


def test_abort_frees_blocks_and_others_finish(smollm2_llm):
    engine = smollm2_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16)
    engine.add_request("keep", PROMPT, params)
    engine.add_request("drop", "A different prompt that will be aborted", params)
    engine.step()
    engine.step()
    aborted = engine.abort_request("drop")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.core.kv_cache.block_ids("drop#0") == []
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    reference = smollm2_llm.generate(PROMPT, params)[0]
    assert _tokens(finished[0]) == _tokens(reference)
    assert engine.core.kv_cache.num_free_blocks == engine.core.runner.num_blocks


def test_prompt_logprobs_cover_the_whole_prompt_with_prefix_caching(smollm2_llm):
    assert smollm2_llm.engine.core.cache_config.enable_prefix_caching
    prompt = " ".join([PROMPT] * 4)  # long enough for several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    smollm2_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))  # fills the cache
    first = smollm2_llm.generate(prompt, params)[0]
    second = smollm2_llm.generate(prompt, params)[0]
    num_prompt = len(first.prompt_token_ids)
    assert num_prompt > 2 * smollm2_llm.engine.core.cache_config.block_size
    assert len(first.prompt_logprobs) == len(second.prompt_logprobs) == num_prompt
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
