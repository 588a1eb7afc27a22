"""LLM.chat renders the model's chat template and continues it like transformers does."""

from __future__ import annotations

import torch

from kvserve import SamplingParams


def test_chat_matches_transformers_on_the_templated_prompt(smollm2_llm, smollm2_hf):
    tokenizer = smollm2_llm.get_tokenizer()
    conversations = [
        [{"role": "user", "content": "Name a primary colour."}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What is frozen water called?"},
        ],
    ]
    outputs = smollm2_llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=20))
    for conversation, output in zip(conversations, outputs):
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert text.rstrip().endswith("assistant")  # the template's generation prompt is there
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert output.prompt_token_ids == ids
        with torch.inference_mode():
            input_ids = torch.tensor([ids])
            reference = smollm2_hf.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=20, pad_token_id=smollm2_hf.config.eos_token_id,
            )[0, len(ids):].tolist()
        assert output.outputs[0].token_ids == reference
