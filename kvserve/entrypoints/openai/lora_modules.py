"""The server's LoRA adapters by name: those of --lora-modules, and those loaded and unloaded
at runtime (/v1/load_lora_adapter, /v1/unload_lora_adapter). A request picks one with
"model": "<adapter name>". Free of server imports: the CLI parser reads --lora-modules with it."""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

from kvserve.lora.request import LoRARequest


class UnknownAdapter(LookupError):
    """No adapter of that name is loaded."""


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None  # the `parent` /v1/models shows (default: the served model)


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or JSON {"name": .., "path": .., "base_model_name": ..} (as vLLM takes them)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: not valid JSON: {error}") from None
        if not isinstance(value, dict) or not {"name", "path"} <= set(value) or set(value) - {
                "name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: a JSON module has \"name\" and \"path\" "
                                             "(and optionally \"base_model_name\"), nothing else")
        return LoRAModule(str(value["name"]), str(value["path"]), value.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return LoRAModule(name, path)


class LoRARegistry:
    """Adapter name -> its request (with an id of its own: an adapter loaded again under the
    same name gets a new id, so its KV blocks are never mistaken for the old one's)."""

    def __init__(self, served_model_name: str) -> None:
        self.served_model_name = served_model_name
        self.modules: dict[str, LoRAModule] = {}
        self.requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new_request(self, module: LoRAModule) -> LoRARequest:
        """A request for an adapter not registered yet; raises ValueError on a name taken."""
        if module.name == self.served_model_name:
            raise ValueError(f"LoRA adapter name {module.name!r} is the base model's name; choose another")
        if module.name in self.requests:
            raise ValueError(f"LoRA adapter {module.name!r} is already loaded (from "
                             f"{self.modules[module.name].path}); unload it first")
        return LoRARequest(module.name, next(self._ids), module.path)

    def add(self, module: LoRAModule, request: LoRARequest) -> None:
        self.modules[module.name] = module
        self.requests[module.name] = request

    def remove(self, name: str) -> LoRARequest:
        if name not in self.requests:
            raise UnknownAdapter(name)
        del self.modules[name]
        return self.requests.pop(name)
