"""Which tokenizer an engine uses: the model's own, one at `tokenizer` (a directory or a GGUF
file), or none (`skip_tokenizer_init`); a directory without tokenizer files fails at load
with an error that says so and names both options."""

from __future__ import annotations

import os
import shutil

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.errors import ModelLoadError
from kvserve.model_executor.loader import load_model

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
PROMPTS = [{"prompt_token_ids": [5, 9, 17, 3]}, {"prompt_token_ids": [30, 31, 4, 4, 8]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """The same weights twice: with the tiny test tokenizer, and without any tokenizer file."""
    from tests.conftest import randomize, save_tokenizer

    root = tmp_path_factory.mktemp("tokenizer_choice")
    with_tokenizer, bare = str(root / "with_tokenizer"), str(root / "bare")
    model = LlamaForCausalLM(CONFIG)
    randomize(model, 0)
    model.save_pretrained(bare)
    shutil.copytree(bare, with_tokenizer)
    save_tokenizer(with_tokenizer, CONFIG.vocab_size)
    return with_tokenizer, bare


def _generate(llm: LLM) -> list[tuple[list[int], str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(PROMPTS, GREEDY)]


def test_directory_without_tokenizer_files_names_both_ways_out(model_dirs) -> None:
    _, bare = model_dirs
    with pytest.raises(ModelLoadError, match=r"bare: no tokenizer files .*--tokenizer.*--skip-tokenizer-init"):
        load_model(bare)


def test_tokenizer_from_another_directory_decodes_like_the_models_own(model_dirs) -> None:
    with_tokenizer, bare = model_dirs
    own = _generate(LLM(model=with_tokenizer, kv_cache_memory="16MiB"))
    borrowed = LLM(model=bare, tokenizer=with_tokenizer, kv_cache_memory="16MiB")
    assert _generate(borrowed) == own
    assert all(text for _, text in own)  # the comparison covers the detokenized text


def test_skip_tokenizer_init_runs_token_ids_and_refuses_text(model_dirs) -> None:
    with_tokenizer, _ = model_dirs
    own = _generate(LLM(model=with_tokenizer, kv_cache_memory="16MiB"))
    llm = LLM(model=with_tokenizer, skip_tokenizer_init=True, kv_cache_memory="16MiB")
    assert llm.get_tokenizer() is None
    assert _generate(llm) == [(tokens, "") for tokens, _ in own]
    with pytest.raises(ValueError, match="no tokenizer .*pass token ids"):
        llm.generate("t5 t9", GREEDY)
    with pytest.raises(ValueError, match=r"stop strings \['t9'\] cannot be matched; use stop_token_ids"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, stop=["t9"]))


def test_tokenizer_from_a_gguf_file() -> None:
    tokenizer = load_model(None, load_format="dummy", model_shape="smollm2-135m",
                           tokenizer=default_model_path()).tokenizer
    assert tokenizer is not None and len(tokenizer) == 49152
    assert tokenizer.decode(tokenizer("The capital of France").input_ids, skip_special_tokens=True) \
        == "The capital of France"


def test_bad_tokenizer_choices_fail_before_any_weight_is_read(model_dirs, tmp_path) -> None:
    with_tokenizer, bare = model_dirs
    with pytest.raises(ValueError, match="tokenizer and skip_tokenizer_init exclude each other"):
        load_model(bare, tokenizer=with_tokenizer, skip_tokenizer_init=True)
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="tokenizer .*nowhere: no such file or directory"):
        load_model(os.path.join(tmp_path, "not-even-read"), tokenizer=missing)
