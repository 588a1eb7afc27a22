"""`quantization="int8"` on CPU: an int8 copy of the LM head for decode rows (by default for
fp32 models, `quantization_config={"lm_head": false}` to keep only the float head), checked
against the fp32 head of the same GGUF weights."""

from __future__ import annotations

import torch

from kvserve.model_executor.loader import load_model
from kvserve.quantization.int8 import Int8Linear


def test_int8_lm_head_tracks_the_fp32_head(smollm2_path, smollm2_loaded):
    loaded = load_model(smollm2_path, dtype=torch.float32, quantization="int8")
    head = loaded.model.quantized_lm_head
    assert isinstance(head, Int8Linear)
    embed = smollm2_loaded.model.model.embed_tokens.weight
    torch.manual_seed(0)
    hidden = smollm2_loaded.model.model.norm(embed[torch.randint(0, embed.shape[0], (6,))] * 30)
    reference = torch.nn.functional.linear(hidden, embed)
    for rows in (1, 6):
        logits = loaded.model.compute_logits(hidden[:rows])
        scale = reference[:rows].abs().amax(dim=-1, keepdim=True)
        assert ((logits - reference[:rows]).abs() / scale).max() < 0.03, rows
        assert torch.equal(logits.argmax(-1), reference[:rows].argmax(-1)), rows
    # The float embedding is untouched (token lookups).
    assert torch.equal(loaded.model.model.embed_tokens.weight, embed)


def test_int8_lm_head_by_default_for_fp32_only_and_as_asked(tiny_model):
    """Opted out, or a bf16 model by default, no copy; asked for, a bf16 model gets one too."""

    def head(dtype: torch.dtype, **config):
        loaded = load_model(tiny_model, dtype=dtype, quantization="int8", quantization_config=config)
        return loaded.model.quantized_lm_head

    assert isinstance(head(torch.float32), Int8Linear)
    assert head(torch.float32, lm_head=False) is None
    assert head(torch.bfloat16) is None
    assert isinstance(head(torch.bfloat16, lm_head=True), Int8Linear)
