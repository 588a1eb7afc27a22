"""The engine front's check of an adapter before its first request is scheduled: read and
validated once per id, so a bad adapter is refused with a clear error and never reaches the
engine core."""

from __future__ import annotations

from kvserve.config import ModelConfig
from kvserve.lora.adapter import LoRAError, load_adapter
from kvserve.lora.config import LoRAConfig
from kvserve.lora.request import LoRARequest


class AdapterChecker:
    def __init__(self, model_config: ModelConfig, lora_config: LoRAConfig | None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self._checked: dict[int, LoRARequest] = {}

    def check(self, request: LoRARequest) -> None:
        if self.lora_config is None:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} requested, but this engine serves the base model "
                            "only; start it with --enable-lora (LLM(..., enable_lora=True))")
        known = self._checked.get(request.lora_int_id)
        if known == request:
            return
        if known is not None:
            raise LoRAError(f"lora_int_id {request.lora_int_id} already names LoRA adapter {known.lora_name!r} "
                            f"({known.lora_path}); give {request.lora_name!r} ({request.lora_path}) an id of its own")
        load_adapter(request, self.model_config, self.lora_config.max_lora_rank)
        self._checked[request.lora_int_id] = request

    def forget(self, lora_int_id: int) -> None:
        self._checked.pop(lora_int_id, None)
