"""The verify pass over a hand-built token tree scores every node exactly as verifying
the chain along its path does (torch reference backend, real SmolLM2)."""

from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams
from kvserve.core.sched.output import SchedulerOutput
from kvserve.spec_decode.tree import tree_attention_mask, tree_depths, tree_step_inputs


def _verify_logits(llm: LLM, seq, drafts: list[int], parents: list[int] | None) -> torch.Tensor:
    """One verify pass of `drafts` after the sequence's last token; the KV it writes for
    the drafts is simply overwritten by the next call."""
    engine = llm.engine
    seq.spec_token_ids, seq.spec_tree_parents = list(drafts), parents
    num_new = 1 + len(drafts)
    assert engine.core.kv_cache.allocate_slots(
        seq.seq_id, seq.all_token_ids, seq.num_computed_tokens, num_new) == []
    sched = SchedulerOutput()
    engine.core.scheduler.add_to_step(sched, seq, num_new)
    step = engine.core.runner.forward(sched)
    assert step.num_sample_rows == [num_new]
    return step.sample_logits


def test_tree_mask_and_depths():
    # Root children 0 and 2; 1 under 0; 3 under 2; 4 under 3.
    parents = [-1, 0, -1, 2, 3]
    assert tree_depths(parents) == [0, 1, 0, 1, 2]
    mask = tree_attention_mask(1, parents, torch.device("cpu")).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 1, 1, 1],
    ]


def test_graph_inputs_of_a_tree():
    """What the CUDA graphs take: positions by depth after the newest token's, and each row's
    bits the hand-written mask row above (bit j: sees query token j)."""
    parents = [-1, 0, -1, 2, 3]
    rows = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0],
            [1, 0, 0, 1, 1, 1]]
    positions, bits = tree_step_inputs(40, parents)
    assert positions == [40, 41, 42, 41, 42, 43]
    assert bits == [sum(seen << j for j, seen in enumerate(row)) for row in rows]


def test_tree_matches_chains(smollm2_loaded):
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="16MiB", max_model_len=256, block_size=4,
              attention_backend="torch")
    engine = llm.engine
    engine.add_request("r", "The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # prefill: one output token, the sequence now decodes
    seq = engine.core.scheduler.running[0]
    assert seq.num_tokens - seq.num_computed_tokens == 1

    branch_a, branch_b = [3681, 30, 378], [6256, 28]
    tree_logits = _verify_logits(llm, seq, branch_a + branch_b, [-1, 0, 1, -1, 3])
    chain_a = _verify_logits(llm, seq, branch_a, None)
    chain_b = _verify_logits(llm, seq, branch_b, None)
    # Rows: the last verified token, then each node (predicting what follows it).
    torch.testing.assert_close(tree_logits[:4], chain_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tree_logits[[0, 4, 5]], chain_b, rtol=1e-4, atol=1e-4)
