"""KV-cache bookkeeping under speculation with many rejections: block tables hold only
verified tokens' blocks after every step, ref counts and the free count are exact, the
pool ends as it does without speculation, and drafts never become prefix-cache hits."""

from __future__ import annotations

from collections import Counter

from kvserve import LLM, SamplingParams
from kvserve.core.kv_cache_manager import hash_block_tokens
from tests.spec_decode.proposers import ScriptedProposer

BLOCK_SIZE = 4
SHARED = "You are a helpful assistant. Keep every answer short and exact. "
PROMPTS = [SHARED + "Name a colour.", SHARED + "Name a river.", SHARED + "Count to five:"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _llm(loaded, speculative: bool) -> LLM:
    config = {"method": "ngram", "num_speculative_tokens": 4} if speculative else None
    return LLM(loaded=loaded, kv_cache_memory="16MiB", max_model_len=256, block_size=BLOCK_SIZE,
               speculative_config=config)


def _check_pool(llm: LLM) -> None:
    kv = llm.engine.core.kv_cache
    holders = Counter(id(block) for table in kv.block_tables.values() for block in table)
    for block in kv.pool.blocks:
        assert block.ref_count == holders.get(id(block), 0)
    in_use = sum(1 for block in kv.pool.blocks if block.ref_count > 0)
    assert kv.num_free_blocks == kv.pool.num_blocks - in_use
    for seq in llm.engine.core.scheduler.running:
        if seq.num_tokens - seq.num_computed_tokens == 1:  # decoding
            # Exactly the blocks of the verified tokens' KV: none kept for rejected drafts.
            assert len(kv.block_tables[seq.seq_id]) == kv.num_blocks_needed(seq.num_computed_tokens)


def _run(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, PARAMS).request_id for p in prompt_ids]
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        _check_pool(llm)
    return [finished[i] for i in ids]


def _verified_hashes(sequences: list[list[int]]) -> set[int]:
    hashes = set()
    for tokens in sequences:
        parent = None
        for i in range(len(tokens) // BLOCK_SIZE):
            parent = hash_block_tokens(parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            hashes.add(parent)
    return hashes


def test_rejections_leave_the_pool_exact(smollm2_loaded):
    prompt_ids = [smollm2_loaded.tokenizer(p).input_ids for p in PROMPTS]
    plain = _llm(smollm2_loaded, speculative=False)
    reference = _run(plain, prompt_ids)

    spec = _llm(smollm2_loaded, speculative=True)
    # The first draft of each run is right, the other three are wrong: every run has
    # rejections, and rejected drafts span block boundaries (block size 4).
    proposer = ScriptedProposer(
        {tuple(p): r for p, r in zip(prompt_ids, reference)},
        smollm2_loaded.config.vocab_size, num_correct=1,
    )
    spec.engine.core.runner.speculator.proposer = proposer
    assert _run(spec, prompt_ids) == reference
    stats = spec.engine.spec_decode_stats
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 3 * stats.num_drafts // 2

    for llm in (plain, spec):
        pool = llm.engine.core.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(block.ref_count == 0 for block in pool.blocks)
    # The same blocks are cached, and each is made of verified tokens only.
    cached = set(spec.engine.core.kv_cache.pool._cached)
    assert cached == set(plain.engine.core.kv_cache.pool._cached)
    assert cached <= _verified_hashes([p + r for p, r in zip(prompt_ids, reference)])

    # A prompt continuing with a rejected draft hits the cache only as far as verified
    # tokens go: exactly as far as it does without speculation.
    wrong = next(d for d in proposer.proposed if len(d) == 4)
    probe = prompt_ids[0] + reference[0][:6] + wrong * 3
    one = SamplingParams(temperature=0.0, max_tokens=1)
    hits = [llm.generate({"prompt_token_ids": probe}, one)[0].num_cached_tokens for llm in (plain, spec)]
    assert hits[0] == hits[1] > 0
