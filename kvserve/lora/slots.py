"""The model runner's side of LoRA: the model's linears wrapped in LoRALinear, which adapter
sits in which device slot, the adapters kept in host memory (least recently used evicted
past max_cpu_loras), and each step's per-token slot index."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from kvserve.lora.config import LoRAConfig
from kvserve.lora.layers import LoRALinear, SlotGroupsCache
from kvserve.lora.request import LoRARequest
from kvserve.lora.targets import lora_linears

logger = logging.getLogger(__name__)


def add_lora_layers(model: nn.Module, model_config: ModelConfig, lora_config: LoRAConfig,
                    token_slots: torch.Tensor, groups_cache: SlotGroupsCache | None = None
                    ) -> dict[str, LoRALinear]:
    """Wrap every linear an adapter may target (after loading and quantization: the base
    stays as it is, the adapters in the run dtype)."""
    layers = {}
    for target in lora_linears(model_config):
        parent_name, _, leaf = target.module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, leaf)
        if isinstance(base, LoRALinear):
            raise ValueError("these weights already serve LoRA adapters for another engine (its slots are "
                             "wrapped around their linears): load the model again for this one")
        layer = LoRALinear(base, target.in_features, target.slice_sizes, lora_config.max_loras,
                           lora_config.max_lora_rank, token_slots, model_config.dtype, groups_cache)
        setattr(parent, leaf, layer)
        layers[target.module_name] = layer
    return layers


class LoRASlots:
    def __init__(self, model: nn.Module, model_config: ModelConfig, lora_config: LoRAConfig,
                 max_tokens: int, device: torch.device) -> None:
        """`max_tokens`: the most tokens a forward pass may have (padded CUDA-graph batches
        included)."""
        self.model_config = model_config
        self.config = lora_config
        # Each token's slot as LoRALinear reads it (-1: base).
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        # Host staging of token_slots, two used in turn (as the CUDA graphs' inputs): a copy
        # from pageable memory would wait for the step in flight, undoing overlapped scheduling.
        self._stagings = [torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
                          for _ in range(2)]
        self._num_steps = 0
        self._num_set = 0  # token_slots rows the last set_tokens wrote
        self.groups_cache = SlotGroupsCache()
        self.layers = add_lora_layers(model, model_config, lora_config, self.token_slots, self.groups_cache)
        if torch.device(device).type == "cuda":
            # One grouping of the tokens by slot a forward pass, shared by every layer.
            model.register_forward_pre_hook(lambda *_: self.groups_cache.begin())
            model.register_forward_hook(lambda *_: self.groups_cache.end(), always_call=True)
        self._slot_ids: list[int] = [0] * lora_config.max_loras  # adapter id per slot (0: empty)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.num_disk_loads = 0

    @property
    def slot_bytes(self) -> int:
        """Device memory of every slot of every layer."""
        return sum(buffer.numel() * buffer.element_size() for layer in self.layers.values()
                   for name, buffer in layer.named_buffers(recurse=False) if name.startswith("lora_"))

    def slot_of(self, lora_int_id: int) -> int:
        """The slot of a resident adapter; -1 for the base model (id 0) and for an adapter
        that could not be loaded (its sequences are failed)."""
        return self._slot_ids.index(lora_int_id) if lora_int_id in self._slot_ids and lora_int_id else -1

    def resident(self) -> list[int]:
        return [lora_id for lora_id in self._slot_ids if lora_id]

    def activate(self, requests: Iterable[LoRARequest], in_use: Iterable[int]) -> dict[int, str]:
        """Put each requested adapter in a device slot, evicting only adapters of no held
        sequence (`in_use`: ids of every sequence the runner holds); the scheduler keeps those
        to max_loras. Returns the adapters that could not be read (id -> the error: e.g.
        deleted from disk after the front checked them), which get no slot."""
        failed = {}
        for request in requests:
            if request.lora_int_id in self._slot_ids:
                self._touch(request)
                continue
            busy = set(in_use)
            free = [slot for slot, lora_id in enumerate(self._slot_ids) if lora_id == 0 or lora_id not in busy]
            if not free:
                raise RuntimeError(f"no free LoRA slot for {request.lora_name!r}: {self.config.max_loras} "
                                   "adapters are in use (the scheduler admits at most max_loras)")
            slot = next((s for s in free if self._slot_ids[s] == 0), free[0])
            try:
                adapter = self._touch(request)
            except LoRAError as error:
                failed[request.lora_int_id] = str(error)
                continue
            for name, layer in self.layers.items():
                slices = adapter.linears.get(name, [])
                layer.set_slot(slot, [(w.slice_index, w.lora_a, w.lora_b) for w in slices])
            self._slot_ids[slot] = request.lora_int_id
        return failed

    def remove(self, lora_int_id: int) -> None:
        """Forget the adapter on the host; its slot is reused once no sequence runs on it."""
        self._host.pop(lora_int_id, None)

    def _touch(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter from the host cache (as most recently used), else read from disk."""
        adapter = self._host.get(request.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.model_config, self.config.max_lora_rank, self.model_config.dtype)
        self.num_disk_loads += 1
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.config.host_capacity:
            evicted, _ = self._host.popitem(last=False)
            logger.info("LoRA host cache: evicted adapter id %d (max_cpu_loras=%d)", evicted,
                        self.config.host_capacity)
        return adapter

    def set_tokens(self, lora_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Each sequence's adapter (0: base) for its tokens of the coming forward pass, in
        batch order."""
        slots = np.repeat(np.array([self.slot_of(lora_id) for lora_id in lora_ids], dtype=np.int32),
                          np.asarray(num_tokens, dtype=np.int64))
        staging = self._stagings[self._num_steps % 2]
        self._num_steps += 1
        staging[: len(slots)] = torch.from_numpy(slots)
        # Rows a longer earlier step set go back to the base model: a CUDA graph's padding
        # rows read them, and would otherwise run (and the grouping count) a stale adapter.
        rows = max(len(slots), self._num_set)
        staging[len(slots) : rows] = -1
        self.token_slots[:rows].copy_(staging[:rows], non_blocking=True)
        self._num_set = len(slots)

