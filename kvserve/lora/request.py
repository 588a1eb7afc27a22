"""Which adapter a request runs with, named as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` (>= 1) identifies the adapter everywhere below the API: its device slot,
    its host-cache entry and the prefix-cache hashes of its KV blocks (0 means the base
    model); two requests with the same id must name the same adapter weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be an integer >= 1 "
                             f"(0 is the base model); got {self.lora_int_id!r}")
