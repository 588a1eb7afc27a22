"""Checkpoints stored quantized (GPTQ, AWQ, written by the tools themselves) split over
tensor-parallel ranks: each rank's layers dequantize to exactly its Megatron share of the
one-process weights (packed dimension, group scales and zero points, act-order g_idx cut
consistently), and two real ranks generate the one-process tokens."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.loader import load_model
from kvserve.model_executor.sharded_loader import load_rank_share
from kvserve.quantization import QuantizedLinear
from tests.quantization.test_checkpoints import FIXTURES, TOOL_FIXTURES, layer_weights

# The fixtures: hidden 64, intermediate 64, 4 heads of 16 over 2 KV heads, groups of 32.
HEAD_DIM = 16


def _megatron_share(name: str, weight: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank` of 2's share of one Hugging Face linear's weight, by Megatron's rules."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("o_proj", "down_proj"):  # row-parallel: input columns
        half = weight.shape[1] // 2
        return weight[:, rank * half : (rank + 1) * half]
    half = weight.shape[0] // 2  # column-parallel: heads (one KV head each) or MLP rows
    return weight[rank * half : (rank + 1) * half]


def _rank_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our linear name (RowParallel's wrapper dropped) -> the weight the rank computes with."""
    weights = {}
    for name, module in model.named_modules():
        if name.endswith("lm_head") or not isinstance(module, (QuantizedLinear, nn.Linear)):
            continue
        weight = module.dequantize() if isinstance(module, QuantizedLinear) else module.weight.detach()
        weights[name.removesuffix(".linear")] = weight
    return weights


@pytest.mark.parametrize("fixture", sorted(TOOL_FIXTURES))
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_share_of_the_dequantized_weights(fixture, rank):
    directory = os.path.join(FIXTURES, fixture)
    whole = load_model(directory)
    expected = layer_weights(whole)  # Hugging Face name -> the one-process weight
    loaded, shape, _ = load_rank_share(directory, torch.float32, torch.device("cpu"),
                                       GroupCoordinator(rank, 2), GroupCoordinator())
    assert loaded.quantization == whole.quantization
    assert (shape.num_attention_heads, shape.num_key_value_heads) == (2, 1)
    ours = _rank_weights(loaded.model)
    kinds = {type(module) for name, module in loaded.model.named_modules()
             if "layers.0." in name and isinstance(module, (QuantizedLinear, nn.Linear))}
    assert kinds == {TOOL_FIXTURES[fixture]}  # still packed where one process keeps it packed
    for name, weight in ours.items():
        shards = whole.model.hf_shard_names(name)
        share = torch.cat([_megatron_share(hf, expected[hf], rank) for hf in shards])
        assert torch.equal(weight, share), name


def test_groups_that_straddle_the_ranks_are_refused(tmp_path):
    """Groups of 32 columns over 4 ranks of 16 columns each: no rank holds whole groups."""
    directory = os.path.join(FIXTURES, "gptq-w4-g32")
    with pytest.raises(ValueError, match="groups of 32 input columns do not split at the 16 columns each of 4 ranks"):
        load_rank_share(directory, torch.float32, torch.device("cpu"), GroupCoordinator(0, 4), GroupCoordinator())


def test_two_ranks_generate_the_one_process_tokens_of_a_gptq_checkpoint():
    directory = os.path.join(FIXTURES, "gptq-w4-g32")
    prompts = [{"prompt_token_ids": [(5 * i + j) % 64 for j in range(3 + 6 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB")
    expected = [o.outputs[0].token_ids for o in LLM(directory, **kwargs).generate(prompts, params)]
    llm = LLM(directory, tensor_parallel_size=2, **kwargs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.shutdown()
