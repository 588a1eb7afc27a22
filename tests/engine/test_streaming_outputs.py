"""A streamed request's outputs show its tokens (and logprobs) so far without copying them
every step: each is a snapshot that later steps do not change, equal to the prefix of the
final output; finished outputs hold plain lists."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.outputs import GrowingListPrefix


def test_prefix_view_reads_like_the_list_prefix_it_was_taken_as() -> None:
    items = [3, 1, 4, 1, 5]
    view = GrowingListPrefix(items)
    items += [9, 2, 6]
    expected = [3, 1, 4, 1, 5]
    assert len(view) == 5 and list(view) == expected and view == expected and view == tuple(expected)
    assert [view[i] for i in range(-5, 5)] == expected[-5:] + expected
    for index in (slice(None), slice(2, None), slice(1, 4), slice(-2, None), slice(None, None, 2), slice(7, 9)):
        assert view[index] == expected[index]
    with pytest.raises(IndexError):
        view[5]
    with pytest.raises(IndexError):
        view[-6]
    assert view != [3, 1, 4, 1, 5, 9] and repr(view) == repr(expected)


def test_streamed_outputs_are_snapshots_of_the_final_output(save_hf_model) -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    llm = LLM(model=save_hf_model(LlamaForCausalLM(config)), kv_cache_memory="16MiB")
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": [5, 9, 17, 3]},
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1))
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [o.outputs[0] for o in engine.step(final_only=False)]
    final = streamed.pop()
    assert type(final.token_ids) is list and type(final.logprobs) is list and len(final.token_ids) == 12
    assert [len(o.token_ids) for o in streamed] == list(range(1, 12))  # unchanged by the steps after them
    for output in streamed:
        assert output.token_ids == final.token_ids[: len(output.token_ids)]
        assert list(output.logprobs) == final.logprobs[: len(output.token_ids)]
