"""The GGUF tokenizer cache: the saved copy tokenizes as transformers' conversion of the file,
and a changed file, a damaged copy or an unwritable cache never serve a wrong tokenizer."""

from __future__ import annotations

import os
import shutil

import pytest
from transformers import AutoTokenizer

from kvserve.model_executor import gguf_tokenizer
from kvserve.model_executor.gguf_tokenizer import cached_tokenizer_dir, load_gguf_tokenizer

TEXTS = ["Hello, world!", "  leading spaces\n\nand\ttabs", "naïve café 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # squared"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def assert_same_tokenizer(ours, reference) -> None:
    for text in TEXTS:
        assert ours(text).input_ids == reference(text).input_ids, text
        assert ours.decode(reference(text).input_ids) == reference.decode(reference(text).input_ids)
    assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id, len(reference))


class CountingConversions:
    """AutoTokenizer whose GGUF conversions are counted (and answered by `converted` where set,
    so the cache's error paths run without converting the file again)."""

    def __init__(self, converted=None) -> None:
        self.calls, self.converted = 0, converted

    def from_pretrained(self, source, gguf_file=None):
        if gguf_file is None:
            return AutoTokenizer.from_pretrained(source)
        self.calls += 1
        return self.converted or AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)


@pytest.fixture(scope="module")
def model_copy(smollm2_path, tmp_path_factory):
    """The SmolLM2 file under a new path: a cache key of its own."""
    path = str(tmp_path_factory.mktemp("gguf") / os.path.basename(smollm2_path))
    shutil.copyfile(smollm2_path, path)
    return path


def test_second_load_reads_the_cache_and_matches_the_conversion(model_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    counting = CountingConversions()
    monkeypatch.setattr(gguf_tokenizer, "AutoTokenizer", counting)
    converted = load_gguf_tokenizer(model_copy)
    assert counting.calls == 1 and (cached_tokenizer_dir(model_copy) / "tokenizer.json").is_file()
    cached = load_gguf_tokenizer(model_copy)
    assert counting.calls == 1
    assert_same_tokenizer(cached, converted)


def test_a_changed_file_gets_a_new_key(model_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    before = cached_tokenizer_dir(model_copy)
    stat = os.stat(model_copy)
    os.utime(model_copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert cached_tokenizer_dir(model_copy) != before
    assert cached_tokenizer_dir(model_copy).parent == tmp_path / "gguf_tokenizers"


def test_damaged_copy_is_converted_again_and_replaced(model_copy, tmp_path, monkeypatch, smollm2_loaded):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    damaged = cached_tokenizer_dir(model_copy)
    damaged.mkdir(parents=True)
    (damaged / "tokenizer.json").write_text("{ not json")
    counting = CountingConversions(converted=smollm2_loaded.tokenizer)
    monkeypatch.setattr(gguf_tokenizer, "AutoTokenizer", counting)
    assert load_gguf_tokenizer(model_copy) is smollm2_loaded.tokenizer and counting.calls == 1
    assert_same_tokenizer(AutoTokenizer.from_pretrained(damaged), smollm2_loaded.tokenizer)


def test_unwritable_cache_still_serves(model_copy, tmp_path, monkeypatch, smollm2_loaded):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(blocker))
    monkeypatch.setattr(gguf_tokenizer, "AutoTokenizer", CountingConversions(converted=smollm2_loaded.tokenizer))
    assert load_gguf_tokenizer(model_copy) is smollm2_loaded.tokenizer
