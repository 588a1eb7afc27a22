"""PEFT adapters for tests: random, non-zero LoRA weights (init_lora_weights=False) on a
Hugging Face model, saved in PEFT's format."""

from __future__ import annotations

import copy
import os

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: PreTrainedModel, directory: str, rank: int, seed: int, use_rslora: bool = False,
                 target_modules: list[str] | None = None, lora_alpha: int | None = None,
                 safe_serialization: bool = True, scale: float = 1.0) -> PeftModel:
    """Save an adapter of a copy of `base` under `directory`; returns the PEFT model (eval).
    `scale` multiplies the random A and B, to keep deltas in proportion on real models."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=lora_alpha or 2 * rank, target_modules=target_modules or ALL_PROJECTIONS,
                        use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.mul_(scale)
    model.save_pretrained(directory, safe_serialization=safe_serialization)
    assert os.path.isfile(os.path.join(directory, "adapter_config.json"))
    return model


def greedy_with_logprobs(model: torch.nn.Module, prompt: list[int], max_new_tokens: int
                         ) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation and the log-softmax of each step's logits [steps, vocab], fp32."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    return tokens[len(prompt):], torch.log_softmax(logits, dim=-1)
