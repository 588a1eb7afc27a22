"""Shared fixtures: the real embedded SmolLM2 model, its transformers reference, and a tiny
random Llama."""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedModel, PreTrainedTokenizerFast

# Keep torch from oversubscribing the cores: pytest-xdist's workers (scripts/test.sh runs one
# per core) share them.
torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)
                          // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
# The servers, engine cores and ranks the tests start as processes likewise: each would take
# every core, its OpenMP threads spinning on the cores the other worker computes on.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


@pytest.fixture(autouse=True)
def seeded_global_rng():
    """Tests that draw from torch's global generator see the same numbers whatever ran before
    them on their xdist worker: a tolerance that passes once passes every time."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def free_gpu_memory_after_gpu_tests(request):
    """An engine sizes its KV cache from the memory the process already holds: free what a
    GPU test's engines held (they may sit in reference cycles) before the next one starts."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kvserve.model_executor.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path, tmp_path_factory, worker_id):
    """transformers' own load of the same GGUF file, dequantized to fp32. transformers parses
    the GGUF's metadata twice to build it (~10 s on 2 cores): under pytest-xdist the first
    worker to need it saves its weights in the run's shared temporary directory, and the
    others build the model from that copy (the same fp32 values) instead of converting again.
    (transformers refuses save_pretrained on a model it loaded from GGUF.)"""
    import fcntl

    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvserve.benchmarks.hf_reference import load_hf_model

    if worker_id == "master":
        return load_hf_model(smollm2_path)
    shared = tmp_path_factory.getbasetemp().parent / "smollm2-hf"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while the first worker converts and saves
        if not (shared / "model.safetensors").is_file():
            model = load_hf_model(smollm2_path)
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            shared.mkdir()
            (shared / "config.json").write_text(json.dumps(config))
            save_model(model, str(shared / "model.safetensors"))
            return model
    config = AutoConfig.from_pretrained(shared)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_model(model, str(shared / "model.safetensors"))
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_path):
    """kvserve's fp32 load of the embedded GGUF; engines in tests share these weights."""
    from kvserve.model_executor.loader import load_model

    return load_model(smollm2_path, dtype=torch.float32)


@pytest.fixture
def smollm2_llm(smollm2_loaded):
    """A fresh engine (own KV cache and scheduler) on the shared weights."""
    from kvserve import LLM

    return LLM(loaded=smollm2_loaded, kv_cache_memory="256MiB", max_model_len=4096)


def randomize(model: PreTrainedModel, seed: int) -> None:
    """Non-trivial values everywhere (HF zero-inits biases and one-inits norms)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)


def save_tokenizer(directory: str, vocab_size: int) -> None:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t2").save_pretrained(directory)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random one-layer Llama with a word-level tokenizer, for tests of what kvserve does
    around a model (the server's health, gauges, shutdown and processes; load options) rather
    than of SmolLM2's tokens: its steps take milliseconds where SmolLM2's take a quarter of a
    second on one thread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = os.path.join(tmp_path_factory.mktemp("tiny"), "tiny")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=4096))
    randomize(model, 0)
    model.save_pretrained(directory)
    save_tokenizer(directory, 64)
    return directory


@pytest.fixture
def save_hf_model(tmp_path) -> Callable[..., str]:
    """Save a randomized HF model (+ a tiny tokenizer) as safetensors; return the dir."""

    def save(model: PreTrainedModel, name: str = "model", seed: int = 0, **kwargs) -> str:
        randomize(model, seed)
        directory = os.path.join(tmp_path, name)
        model.save_pretrained(directory, **kwargs)
        save_tokenizer(directory, model.config.vocab_size)
        return directory

    return save
