"""Each rank reads only its own slice of a safetensors checkpoint: what it holds equals what
shard_model (and keep_stage) cut from the whole loaded model, tensor for tensor, and the
bytes it asked for are its share, counted from the files' own headers. Ranks are played in
one process (loading needs no collective); test_tensor_parallel.py runs real ones."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from kvserve.distributed.parallel_state import GroupCoordinator
from kvserve.model_executor.loader import load_model
from kvserve.model_executor.pipeline_parallel import keep_stage
from kvserve.model_executor.sharded_loader import load_rank_share
from kvserve.model_executor.tensor_parallel import shard_model
from tests.distributed.test_expert_parallel import SMALL
from tests.distributed.test_tensor_parallel import _save_tiny

_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def _header(model_dir: str) -> dict[str, tuple[list[int], int]]:
    """Tensor name -> (shape, bytes per element), read from the safetensors header itself."""
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: (entry["shape"], _BYTES[entry["dtype"]]) for name, entry in header.items()
            if name != "__metadata__"}


def _expected_bytes(header, tp: int, rank: int, vocab_rows: int) -> int:
    """Bytes a rank of `tp` needs (the tiny Llama): 1/tp of every split linear (of the 4 KV
    heads, one for tp > 4), its `vocab_rows` of the vocabulary padded to 64 x tp (the last
    rank's fewer), norms whole."""
    total = 0
    for name, (shape, size) in header.items():
        numel = 1
        for dim in shape:
            numel *= dim
        if "embed_tokens" in name or "lm_head" in name:
            rows = max(0, min(vocab_rows, shape[0] - rank * vocab_rows))
            total += rows * shape[1] * size
        elif name.endswith("norm.weight"):
            total += numel * size
        elif "k_proj" in name or "v_proj" in name:  # 4 KV heads: ranks beyond 4 read a copy of one
            total += numel // min(tp, 4) * size
        else:
            total += numel // tp * size
    return total


def _reference(model_dir: str, tp: int, rank: int, pp: GroupCoordinator, expert_parallel: bool = False):
    model = load_model(model_dir, dtype=torch.float32).model
    if pp.world_size > 1:
        keep_stage(model, pp)
    shard_model(model, GroupCoordinator(rank, tp), expert_parallel)
    return model.state_dict()


def _assert_same_tensors(ours: dict, reference: dict) -> None:
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize(("tp", "rank"), [(2, 0), (2, 1), (8, 5)], ids=["tp2-rank0", "tp2-rank1", "tp8-rank5"])
def test_a_rank_reads_its_slice_and_holds_what_shard_model_cuts(tmp_path_factory, tp, rank):
    """Untied, vocabulary 250 (the last rank's rows padded), 8 heads over 4 KV heads: with 8
    ranks every rank holds a copy of one KV head."""
    model_dir = _save_tiny(tmp_path_factory, tie_word_embeddings=False)
    loaded, shape, read = load_rank_share(model_dir, torch.float32, torch.device("cpu"),
                                          GroupCoordinator(rank, tp), GroupCoordinator())
    _assert_same_tensors(loaded.model.state_dict(), _reference(model_dir, tp, rank, GroupCoordinator()))
    assert (shape.num_attention_heads, shape.num_key_value_heads) == (8 // tp, max(1, 4 // tp))
    assert shape.vocab_size == 250 and loaded.model.config.vocab_size == 250
    header = _header(model_dir)
    assert read.checkpoint_bytes == sum(s * torch.Size(shape).numel() for shape, s in header.values())
    assert read.bytes_read == _expected_bytes(header, tp, rank, -(-250 // (64 * tp)) * 64)
    if tp == 2:
        assert 0.45 < read.bytes_read / read.checkpoint_bytes < 0.55


def test_a_stage_reads_only_its_own_layers(tmp_path_factory):
    model_dir = _save_tiny(tmp_path_factory, num_hidden_layers=3, tie_word_embeddings=True)
    stage = GroupCoordinator(1, 2, ranks=(0, 1))
    loaded, shape, read = load_rank_share(model_dir, torch.float32, torch.device("cpu"),
                                          GroupCoordinator(1, 2), stage)
    _assert_same_tensors(loaded.model.state_dict(), _reference(model_dir, 2, 1, stage))
    assert shape.num_hidden_layers == 1
    header = _header(model_dir)
    # Layer 2 (the stage's), the final norm and (tied) the embedding as the LM head.
    other_stage = ("model.layers.0.", "model.layers.1.")
    kept = {name: entry for name, entry in header.items() if not name.startswith(other_stage)}
    assert read.bytes_read == _expected_bytes(kept, 2, 1, 128)


@pytest.mark.parametrize(("architecture", "expert_parallel"), [("qwen2-moe", False), ("mixtral", True)])
def test_mixtures_read_their_rows_or_their_own_experts(save_hf_model, architecture, expert_parallel):
    model = (Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[0]))
        if architecture == "qwen2-moe" else
        MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)))
    model_dir = save_hf_model(model, name=architecture)
    loaded, _, read = load_rank_share(model_dir, torch.float32, torch.device("cpu"), GroupCoordinator(1, 2),
                                      GroupCoordinator(), expert_parallel)
    _assert_same_tensors(loaded.model.state_dict(), _reference(model_dir, 2, 1, GroupCoordinator(), expert_parallel))
    assert 0.4 < read.bytes_read / read.checkpoint_bytes < 0.6
