"""Every adapter kvserve cannot run is refused with an error naming the adapter, the value
and the limit; the engine goes on serving."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.lora import LoRAError, LoRARequest
from kvserve.model_executor.loader import load_model
from tests.lora.peft_adapters import make_adapter
from tests.lora.tiny_model import TINY, save_adapters, save_tiny_llama


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad")
    base = save_tiny_llama(str(directory / "model"))
    good = save_adapters(base, str(directory), [16])[0]
    llm = LLM(loaded=load_model(str(directory / "model"), dtype=torch.float32), enable_lora=True,
              max_lora_rank=8, kv_cache_memory="16MiB", block_size=4)
    return llm, directory, base, good


def refused(llm: LLM, request: LoRARequest) -> str:
    with pytest.raises(LoRAError) as error:
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), lora_request=request)
    # The engine still serves.
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    return str(error.value)


def test_path_without_adapter(setup, tmp_path) -> None:
    llm = setup[0]
    message = refused(llm, LoRARequest("ghost", 1, str(tmp_path / "nowhere")))
    assert "'ghost'" in message and "does not exist" in message
    message = refused(llm, LoRARequest("empty", 2, str(tmp_path)))
    assert "'empty'" in message and "adapter_config.json" in message


def test_rank_above_max_lora_rank(setup) -> None:
    llm, _, _, good = setup
    message = refused(llm, good)
    assert "rank 16" in message and "--max-lora-rank 8" in message and "'adapter1'" in message


def test_adapter_of_another_architecture(setup, tmp_path) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256))
    peft = get_peft_model(gpt2, LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    peft.save_pretrained(str(tmp_path / "gpt2"))
    message = refused(setup[0], LoRARequest("gpt2-lora", 3, str(tmp_path / "gpt2")))
    assert "'gpt2-lora'" in message and "transformer.h.0.attn.c_attn" in message and "LlamaForCausalLM" in message


def test_adapter_of_another_hidden_size(setup, tmp_path) -> None:
    other = LlamaForCausalLM(LlamaConfig(**{**TINY, "hidden_size": 32}))
    make_adapter(other, str(tmp_path / "other"), 4, seed=0)
    message = refused(setup[0], LoRARequest("narrow", 4, str(tmp_path / "other")))
    assert "'narrow'" in message and "needs (4, 96) and (64, 4)" in message and "another base model" in message


def test_target_module_the_model_lacks(setup, tmp_path) -> None:
    deeper = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 3}))
    make_adapter(deeper, str(tmp_path / "deeper"), 4, seed=0, target_modules=["q_proj"])
    message = refused(setup[0], LoRARequest("deep", 5, str(tmp_path / "deeper")))
    assert "'deep'" in message and "model.layers.2.self_attn.q_proj" in message and "2 layers" in message
    make_adapter(setup[2], str(tmp_path / "head"), 4, seed=0, target_modules=["q_proj", "lm_head"])
    assert "lm_head" in refused(setup[0], LoRARequest("head", 6, str(tmp_path / "head")))


def test_unsupported_config(setup, tmp_path) -> None:
    llm, _, base, _ = setup
    make_adapter(base, str(tmp_path / "biased"), 4, seed=0)
    config_path = tmp_path / "biased" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["bias"] = "all"
    config_path.write_text(json.dumps(config))
    assert "bias='all'" in refused(llm, LoRARequest("biased", 7, str(tmp_path / "biased")))


def test_one_id_for_two_adapters(setup, tmp_path) -> None:
    llm, _, base, _ = setup
    for name in ("a", "b"):
        make_adapter(base, str(tmp_path / name), 4, seed=0)
    llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1),
                 lora_request=LoRARequest("a", 9, str(tmp_path / "a")))
    message = refused(llm, LoRARequest("b", 9, str(tmp_path / "b")))
    assert "lora_int_id 9" in message and "'a'" in message


def test_lora_request_without_enable_lora(setup) -> None:
    _, directory, _, good = setup
    llm = LLM(loaded=load_model(str(directory / "model"), dtype=torch.float32), kv_cache_memory="16MiB")
    assert "--enable-lora" in refused(llm, good)


def test_missing_weights_file(setup, tmp_path) -> None:
    llm, _, base, _ = setup
    make_adapter(base, str(tmp_path / "half"), 4, seed=0)
    os.remove(tmp_path / "half" / "adapter_model.safetensors")
    message = refused(llm, LoRARequest("half", 10, str(tmp_path / "half")))
    assert "adapter_model.safetensors or adapter_model.bin" in message
    shutil.rmtree(tmp_path / "half")


def test_adapter_deleted_after_its_check_fails_only_its_request(setup, tmp_path) -> None:
    """Evicted from the host cache, then gone from disk: its next request fails with the
    reason, the others in the same step run."""
    _, directory, base, _ = setup
    llm = LLM(loaded=load_model(str(directory / "model"), dtype=torch.float32), enable_lora=True, max_loras=1,
              max_cpu_loras=1, kv_cache_memory="16MiB", block_size=4)
    first, second = (LoRARequest(name, index, str(tmp_path / name)) for index, name in ((1, "first"), (2, "second")))
    for request in (first, second):
        make_adapter(base, request.lora_path, 4, seed=request.lora_int_id)
    params = SamplingParams(max_tokens=2)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params, lora_request=first)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params, lora_request=second)  # evicts `first` from the host
    shutil.rmtree(first.lora_path)
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, lora_request=[first, None])
    assert "'first'" in outputs[0].error and "does not exist" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 2
