"""The dashboard's view of the engine core (block map, queues, step timeline) against values
worked out by hand for the scripted requests of test_kv_report.py: a prompt whose blocks stay
cached, a second prompt that hits two of them, and an n=2 request whose samples share blocks
until copy-on-write."""

from __future__ import annotations

from collections import Counter

from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.core.block_map import CACHED, FIRST_OWNER, FREE, SHARED, BlockMap

BLOCK = 4
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _cells(snapshot: dict) -> Counter:
    """Blocks per state, and per owning request id, decoded from the run-length map."""
    block_map = BlockMap(**snapshot["block_map"])
    names = {FREE: "free", CACHED: "cached", SHARED: "shared"}
    return Counter(names.get(code) or block_map.owners[code - FIRST_OWNER] for code in block_map.codes())


def test_block_map_queues_and_steps_by_hand(save_hf_model) -> None:
    llm = LLM(model=save_hf_model(LlamaForCausalLM(LlamaConfig(**SMALL))), block_size=BLOCK,
              kv_cache_memory="1MiB", max_model_len=64, enable_prefix_caching=True)
    engine = llm.engine
    total = engine.client.info.num_blocks
    prompt = list(range(10, 20))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    three = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    # Nobody watching: no step is recorded.
    llm.generate([{"prompt_token_ids": prompt}], one)
    assert engine.core.step_timeline.take() == []
    # 10 tokens: blocks [10-13] [14-17] full and cached once the request ends, [18-19] not.
    idle = engine.dashboard_snapshot()
    assert _cells(idle) == {"cached": 2, "free": total - 2}
    assert (idle["running"], idle["waiting"], idle["steps"]) == ([], [], [])

    # A (11 tokens) hits the two cached blocks and takes a third; B (6 tokens, n=2) takes two
    # blocks, and its samples share both once the prompt forks.
    a = prompt[:8] + [40, 41, 42]
    b = list(range(50, 56))
    snapshots = []
    llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}],
                 [three, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3)],
                 on_step=lambda: snapshots.append(engine.dashboard_snapshot()))
    first, second = snapshots[:2]
    (a_id,) = {row["request"] for row in first["running"] if row["prompt_tokens"] == 11}
    (b_id,) = {row["request"] for row in first["running"] if row["prompt_tokens"] == 6}
    assert _cells(first) == {a_id: 3, "shared": 2, "free": total - 5}
    assert first["block_map"]["owners"] == [a_id]  # B's samples hold no block alone
    # The first step prefilled A's 3 uncached tokens and B's 6; B forked after it.
    assert first["steps"] == [[first["steps"][0][0], 3 + 6, 0, 2, 0]]
    assert [(r["request"], r["sample"], r["computed_tokens"], r["blocks"]) for r in first["running"]] == [
        (a_id, 0, 11, 3), (b_id, 0, 6, 2), (b_id, 1, 6, 2)]
    # One decode token each: A fills its third block; the first sample of B to write the
    # shared partial block copies it, so each sample holds one block alone.
    assert _cells(second) == {a_id: 3, b_id: 2, "shared": 1, "free": total - 6}
    assert second["steps"][0][1:] == [0, 3, 3, 0]
    assert second["kv"]["blocks"]["used"] == 6 and second["num_running"] == 3
    # Every request has ended: their full blocks are cached, the rest free.
    final = engine.dashboard_snapshot()
    assert final["block_map"]["owners"] == [] and final["num_running"] == 0
    cells = _cells(final)
    assert cells["cached"] == final["kv"]["blocks"]["cached"] and cells["free"] == final["kv"]["blocks"]["free"]
