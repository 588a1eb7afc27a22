"""The embedded SmolLM2 GGUF against transformers' own GGUF loader."""

from __future__ import annotations


import pytest
import torch

from kvserve.model_executor.default_model import default_model_path
from kvserve.model_executor.loader import LoadedModel


@pytest.fixture(scope="module")
def ours(smollm2_loaded) -> LoadedModel:
    return smollm2_loaded


@pytest.fixture(scope="module")
def reference(smollm2_hf):
    return smollm2_hf


def test_default_model_path() -> None:
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_config_and_tokenizer(ours: LoadedModel) -> None:
    config = ours.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == [ours.tokenizer.eos_token_id] == [2]
    text = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in text


def test_weights_equal_transformers(ours: LoadedModel, reference) -> None:
    views = ours.model.hf_weight_views()
    reference_state = reference.state_dict()
    assert set(views) == set(reference_state) - {"lm_head.weight"}  # tied
    for name, view in views.items():
        assert torch.equal(view, reference_state[name]), name


def test_logits_match_transformers(ours: LoadedModel, reference, paged_runner) -> None:
    tokens = ours.tokenizer("The capital of France is")["input_ids"]
    (logits,) = paged_runner(ours.model, ours.config, num_blocks=8).step([(0, tokens)])
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, -1].float()
    torch.testing.assert_close(logits[-1], expected, atol=1e-3, rtol=0)


def _reader_view(reader) -> tuple[dict, list]:
    from gguf import GGUFValueType

    scalars = {name: field.contents() for name, field in reader.fields.items()
               if field.types[0] != GGUFValueType.ARRAY}
    tensors = [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.data.tobytes()) for t in reader.tensors]
    return scalars, tensors


def test_scalar_fields_reader_matches_gguf_py_on_smollm2() -> None:
    """kvserve's reader steps over array values (the vocabulary) instead of viewing each
    string: every scalar field and tensor as gguf-py reads them, the arrays absent."""
    from gguf import GGUFReader

    from kvserve.model_executor.gguf_loader import open_gguf

    ours, reference = open_gguf(default_model_path()), GGUFReader(default_model_path())
    assert _reader_view(ours) == _reader_view(reference)
    assert "tokenizer.ggml.tokens" in reference.fields and "tokenizer.ggml.tokens" not in ours.fields


def test_scalar_fields_reader_steps_over_every_kind_of_array(tmp_path) -> None:
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    from kvserve.model_executor.gguf_loader import open_gguf

    path = str(tmp_path / "arrays.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_array("test.strings", ["", "a", "long string " * 50, "ü"])
    writer.add_uint32("test.between", 7)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 2.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.after", "end")
    writer.add_tensor("t.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    ours = open_gguf(path)
    assert _reader_view(ours) == _reader_view(GGUFReader(path))
    assert ours.fields["test.between"].contents() == 7 and ours.fields["test.after"].contents() == "end"
    assert not {"test.strings", "test.ints", "test.floats", "test.bools", "test.nested"} & set(ours.fields)
