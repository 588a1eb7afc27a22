"""Bad speculative_config values fail at engine start, naming field, value and range."""

from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.entrypoints.cli import build_parser
from kvserve.spec_decode.config import SpeculativeConfig


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid; allowed: an integer in [1, 16]"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens=17 is invalid; allowed: an integer in [1, 16]"),
        ({"method": "lookahead", "num_speculative_tokens": 2},
         "method='lookahead' is invalid; allowed: one of ['ngram', 'draft_model', 'medusa', 'eagle', 'eagle3', 'jump_forward']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
         "prompt_lookup_min=5 is invalid; allowed: <= prompt_lookup_max (3)"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None is invalid"),
        ({"method": "draft_model", "model": "same", "num_speculative_tokens": 2, "quantization": "int3"},
         "quantization='int3' is invalid"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead=3 is invalid"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
    ],
)
def test_bad_config_is_a_clear_error(config, expected):
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.from_dict(config)
    assert expected in str(error.value)


def test_engine_start_fails_on_bad_config(smollm2_loaded):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=32 .*\[1, 16\]"):
        LLM(loaded=smollm2_loaded, kv_cache_memory="16MiB", max_model_len=256,
            speculative_config={"method": "ngram", "num_speculative_tokens": 32})


def test_draft_with_other_vocabulary_is_rejected(smollm2_loaded, save_hf_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    path = save_hf_model(LlamaForCausalLM(small), "other_vocab")
    with pytest.raises(ValueError, match=r"model=.*vocabulary of 64 tokens; allowed: the target's vocabulary \(49152"):
        LLM(loaded=smollm2_loaded, kv_cache_memory="16MiB", max_model_len=256,
            speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})


def test_draft_with_other_tokenizer_is_rejected(smollm2_loaded, save_hf_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    # Same vocabulary size as the target, but the tiny test tokenizer's strings.
    small = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    path = save_hf_model(LlamaForCausalLM(small), "other_tokenizer")
    with pytest.raises(ValueError, match="different tokenizer"):
        LLM(loaded=smollm2_loaded, kv_cache_memory="16MiB", max_model_len=256,
            speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})


def test_cli_flag_parses_json():
    args = build_parser().parse_args(
        ["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--speculative-config", "[1]"])
