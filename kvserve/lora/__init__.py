"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch."""

from kvserve.lora.adapter import LoRAError
from kvserve.lora.request import LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
