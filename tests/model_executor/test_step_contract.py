"""The scheduler's steps are plain data: pickled, they drive a model runner in another
process to the same logits, step for step (what a tensor-parallel worker will receive)."""

from __future__ import annotations

import multiprocessing
import pickle

import torch

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.proposer import Draft

# Small steps so that a prompt is prefilled in chunks beside other sequences' decodes.
ENGINE_KWARGS = dict(
    kv_cache_memory="32MiB", block_size=16, max_num_batched_tokens=40,
    attention_backend="torch", enable_prefix_caching=True,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3},
)
SHARED_PREFIX = "one two three four five six seven eight nine ten " * 4


class ConstantDrafts:
    """Drafts every sequence that may draft with a fixed token (mostly rejected): every
    such decode step carries drafts."""

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        return [Draft([7] * k) for k in num_tokens]

    def retain(self, seq_ids) -> None:
        pass


def _record_steps(llm: LLM) -> tuple[list[bytes], list[torch.Tensor]]:
    """Drive the engine: a prompt that drafts while it decodes, one with two samples that
    never drafts (n > 1) and forks, and once both decode a prompt sharing the first one's
    prefix (a prefix hit), prefilled in chunks."""
    engine = llm.engine
    engine.speculator.proposer = ConstantDrafts()
    steps: list[bytes] = []
    logits: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording_execute(sched):
        steps.append(pickle.dumps(sched))
        result = execute(sched)
        logits.append(result.sample_logits.clone())
        return result

    engine.runner.execute = recording_execute
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    drafting = engine.add_request("a", SHARED_PREFIX, greedy).sequences[0]
    engine.add_request("c", "Two samples of this", SamplingParams(
        n=2, temperature=0.8, seed=0, max_tokens=12, ignore_eos=True))
    while drafting.num_computed_tokens < drafting.num_prompt_tokens or not drafting.output_token_ids:
        engine.step()
    engine.add_request("b", SHARED_PREFIX + "and then something else entirely " * 10, greedy)
    while engine.has_unfinished_requests():
        engine.step()
    return steps, logits


def _replay_in_fresh_process(model_path: str, steps: list[bytes], result_file: str, num_threads: int) -> None:
    from kvserve.model_executor.loader import load_model

    torch.set_num_threads(num_threads)  # as many as the recording: fp32 sums in the same order
    loaded = load_model(model_path, dtype=torch.float32)
    runner = LLM(loaded=loaded, **ENGINE_KWARGS).engine.runner
    logits = [runner.execute(pickle.loads(step)).sample_logits for step in steps]
    with open(result_file, "wb") as f:
        pickle.dump(logits, f)


def test_pickled_steps_replay_in_another_process(smollm2_loaded, smollm2_path, tmp_path):
    llm = LLM(loaded=smollm2_loaded, **ENGINE_KWARGS)
    steps, expected = _record_steps(llm)

    decoded = [pickle.loads(step) for step in steps]

    def is_mixed(out) -> bool:
        """A prefix hit prefilled in a chunk, beside drafts and a plain decode."""
        hit_chunk = any(
            new.num_computed_tokens > 0
            and out.num_scheduled_tokens[new.seq_id] < len(new.token_ids) - new.num_computed_tokens
            for new in out.new_seqs
        )
        plain_decode = any(n == 1 for n in out.num_scheduled_tokens.values())
        return hit_chunk and bool(out.spec_token_ids) and plain_decode

    assert any(is_mixed(out) for out in decoded)
    assert any(out.cached_seqs and out.block_copies for out in decoded)  # the samples' copy-on-write
    assert any(out.finished_seq_ids for out in decoded)

    result_file = tmp_path / "logits.pkl"
    process = multiprocessing.get_context("spawn").Process(
        target=_replay_in_fresh_process,
        args=(smollm2_path, steps, str(result_file), torch.get_num_threads()),
    )
    process.start()
    process.join(timeout=600)
    assert process.exitcode == 0
    replayed = pickle.loads(result_file.read_bytes())
    assert len(replayed) == len(expected)
    for step, (got, want) in enumerate(zip(replayed, expected)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
