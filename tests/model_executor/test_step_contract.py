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
    kv_cache_memory="32MiB", max_model_len=512, block_size=16, max_num_batched_tokens=40,
    attention_backend="torch", enable_prefix_caching=True,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3},
)
SHARED_PREFIX = "one two three four five six seven eight nine ten " * 4


class ConstantDrafts:
    """Drafts every sequence that may draft with a fixed token (mostly rejected): every
    such decode step carries drafts."""

    needs_hidden_states = False

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        return [Draft([7] * k) for k in num_tokens]

    def retain(self, seq_ids) -> None:
        pass


def _record(runner, steps: list[bytes], logits: list[torch.Tensor], outputs: list[bytes]) -> None:
    """Record what the runner gets (pickled), the logits of its forward passes and what
    it hands back (pickled)."""
    runner.speculator.proposer = ConstantDrafts()
    execute, forward = runner.execute, runner.forward

    def recording_execute(sched):
        steps.append(pickle.dumps(sched))
        result = execute(sched)
        outputs.append(pickle.dumps(result))
        return result

    def recording_forward(sched):
        result = forward(sched)
        logits.append(result.sample_logits.clone())
        return result

    runner.execute, runner.forward = recording_execute, recording_forward


def _record_steps(llm: LLM) -> tuple[list[bytes], list[torch.Tensor], list[bytes]]:
    """Drive the engine: a prompt that drafts while it decodes, one with two samples that
    never drafts (n > 1) and forks, and once both decode a prompt sharing the first one's
    prefix (a prefix hit), prefilled in chunks."""
    engine = llm.engine
    steps: list[bytes] = []
    logits: list[torch.Tensor] = []
    outputs: list[bytes] = []
    _record(engine.core.runner, steps, logits, outputs)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", SHARED_PREFIX, greedy)
    drafting = engine.core.requests["a"].sequences[0]
    engine.add_request("c", "Two samples of this", SamplingParams(
        n=2, temperature=0.8, seed=0, max_tokens=12, ignore_eos=True))
    while drafting.num_computed_tokens < drafting.num_prompt_tokens or not drafting.output_token_ids:
        engine.step()
    engine.add_request("b", SHARED_PREFIX + "and then something else entirely " * 10, greedy)
    while engine.has_unfinished_requests():
        engine.step()
    return steps, logits, outputs


def _replay_in_fresh_process(model_path: str, steps: list[bytes], result_file: str, num_threads: int) -> None:
    from kvserve.model_executor.loader import load_model

    torch.set_num_threads(num_threads)  # as many as the recording: fp32 sums in the same order
    loaded = load_model(model_path, dtype=torch.float32)
    runner = LLM(loaded=loaded, **ENGINE_KWARGS).engine.core.runner
    logits: list[torch.Tensor] = []
    outputs: list[bytes] = []
    _record(runner, [], logits, outputs)
    for step in steps:
        runner.execute(pickle.loads(step))
    with open(result_file, "wb") as f:
        pickle.dump((logits, [pickle.loads(output) for output in outputs]), f)


def test_pickled_steps_replay_in_another_process(smollm2_loaded, smollm2_path, tmp_path):
    llm = LLM(loaded=smollm2_loaded, **ENGINE_KWARGS)
    steps, expected, expected_outputs = _record_steps(llm)

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
    assert any(out.forks for out in decoded)  # the two samples, forked at their prompt's end

    result_file = tmp_path / "logits.pkl"
    process = multiprocessing.get_context("spawn").Process(
        target=_replay_in_fresh_process,
        args=(smollm2_path, steps, str(result_file), torch.get_num_threads()),
    )
    process.start()
    process.join(timeout=600)
    assert process.exitcode == 0
    replayed, replayed_outputs = pickle.loads(result_file.read_bytes())
    assert len(replayed) == len(expected)
    for step, (got, want) in enumerate(zip(replayed, expected)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    # The same tokens, verified runs and next drafts: the seeded samples draw from
    # generators the replaying runner seeds itself.
    assert replayed_outputs == [pickle.loads(output) for output in expected_outputs]
    assert any(s.num_drafts for output in replayed_outputs for s in output.sampled)
